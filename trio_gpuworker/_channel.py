"""The thin trio shell around a sans-I/O Connection, shared by the daemon's and the worker's side."""

from __future__ import annotations

from typing import Any

import trio

from ._proto import CLOSED, NEED_DATA, Connection, Message

RECV_CHUNK = 1 << 20


async def receive_message(conn: Connection, stream: trio.abc.ReceiveStream) -> Message | None:
    """The next message, or None once the peer closed its end between frames."""
    while True:
        ev = conn.next_event()
        if isinstance(ev, Message):
            return ev
        if ev is CLOSED:
            return None
        assert ev is NEED_DATA
        conn.receive_data(await stream.receive_some(RECV_CHUNK))


def encode_messages(conn: Connection, messages: list[tuple[Any, ...]]) -> bytes:
    """Several small messages as one buffer, for one write: each (t, fields), or (t, fields, raw frame)."""
    return b"".join(bytes(chunk) for t, fields, *raw in messages for chunk in conn.send(t, fields, *raw))
