"""Feeding the sans-I/O Connection by hand: control frames built byte by byte, the messages a receiver should
produce, whole and bytewise feeds, and a daemon and a worker connection past the handshake."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import cbor2

from trio_gpuworker._proto import (
    CLOSED,
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    WORKER,
    Connection,
    Hello,
    WireMessage,
    decode,
    encode_frame,
    hello_fields,
)

ENGINE = {"engine": "fake", "version": "1", "build_flags": []}
Event = Any  # a message class, NEED_DATA or CLOSED


def ctrl(t: str, **fields: Any) -> bytes:
    """A control frame built by hand, so the receiving side can be shown anything."""
    return encode_frame(cbor2.dumps({"t": t, **fields}))


def msg(t: str, raw: bytes | None = None, **fields: Any) -> WireMessage:
    """The message the receiver should produce: the class of `t` with these fields."""
    return decode(t, {"t": t, **fields}, raw)


def whole(data: bytes) -> Iterator[bytes]:
    """`data` in one chunk."""
    if data:
        yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    """`data` one byte at a time."""
    for i in range(len(data)):
        yield data[i : i + 1]


FEEDS = [whole, bytewise]


def events(conn: Connection, data: bytes, feed: Callable[[bytes], Iterator[bytes]] = whole,
           eof: bool = False) -> list[Event]:
    """Feed `data` chunk by chunk (then EOF if asked); every event up to NEED_DATA or CLOSED."""
    out: list[Event] = []

    def drain() -> None:
        while (event := conn.next_event()) is not NEED_DATA:
            out.append(event)
            if event is CLOSED:
                return

    for chunk in feed(data):
        conn.receive_data(chunk)
        drain()
    if eof:
        conn.receive_data(b"")
        drain()
    return out


def joined(chunks: list[bytes | memoryview]) -> bytes:
    """What a `send` or `send_map` returned, as the bytes on the wire."""
    return b"".join(bytes(c) for c in chunks)


def established(max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Connection, Connection]:
    """A daemon and a worker connection that have completed the handshake with each other."""
    daemon, worker = Connection(DAEMON), Connection(WORKER)
    [hello] = events(daemon, joined(worker.send_map("HELLO", hello_fields("n0", 7, max_frame, ENGINE))))
    assert isinstance(hello, Hello)
    ack = {"v": 3, "accept": True, "max_frame": max_frame, "generation": 1}
    assert events(worker, joined(daemon.send_map("HELLO_ACK", ack))) == [msg("HELLO_ACK", **ack)]
    assert daemon.handshake_done and worker.handshake_done
    return daemon, worker


def daemon_side() -> Connection:
    """The daemon's end of an established connection."""
    return established()[0]


def worker_side() -> Connection:
    """The worker's end of an established connection."""
    return established()[1]
