"""The thin trio shell around a sans-I/O Connection, shared by the daemon's and the worker's side."""

from __future__ import annotations

import os
from collections.abc import Sequence

import trio

from ._proto import CLOSED, NEED_DATA, Connection, WireMessage

RECV_CHUNK = 1 << 20


FAIR_READS = 16  # reads in a row that may skip the scheduler pass; the next one yields
WRITEV_CHUNKS = 64  # more pieces than this go through send_all: writev refuses more than IOV_MAX (1024 on Linux)


class MessageReader:
    """A connection's messages, read from its stream. trio's receive_some yields once after every successful
    recv, one event-loop pass of an EXECUTE_STEP echo on each side; this reads the socket itself: bytes already
    waiting are taken at once, else it waits for readability and then reads without the extra pass. Every
    FAIR_READS-th read in a row still yields, so a peer that floods the socket cannot starve the other tasks
    (the watchdogs among them). Errors are trio's, as receive_some raises them."""

    def __init__(self, conn: Connection, stream: trio.abc.ReceiveStream) -> None:
        self.conn, self.stream = conn, stream
        self._streak = 0

    async def receive(self) -> WireMessage | None:
        """The next message, or None once the peer closed its end between frames."""
        conn = self.conn
        while True:
            ev = conn.next_event()
            if ev is CLOSED:
                return None
            if ev is not NEED_DATA:
                return ev  # type: ignore[return-value]
            conn.receive_data(await self._read())

    async def _read(self) -> bytes:
        stream = self.stream
        if not isinstance(stream, trio.SocketStream):
            return await stream.receive_some(RECV_CHUNK)
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._streak >= FAIR_READS:
            self._streak = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        while True:
            try:
                data = os.read(_fd(stream), RECV_CHUNK)
            except BlockingIOError:
                self._streak = 0
                await trio.lowlevel.wait_readable(stream.socket)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            self._streak += 1
            return data


def encode_messages(conn: Connection, messages: Sequence[WireMessage]) -> bytes:
    """Several small messages as one buffer, for one write."""
    return b"".join(bytes(chunk) for msg in messages for chunk in conn.send(msg))


def _fd(stream: trio.SocketStream) -> int:
    """The socket's fd, asked for each time: a closed socket's is -1, never a number reused since."""
    if (fd := stream.socket.fileno()) < 0:
        raise trio.ClosedResourceError("this stream was already closed")
    return fd


class Held:
    """`async with Held(lock)`: `async with lock`, without its scheduler pass when the lock is free. With
    `send_chunks` a control message written on a free lock costs no pass: trio's Lock.acquire and send_all yield
    once each, a third of an EXECUTE_STEP echo's event-loop passes on each side."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller writes nothing, as before
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


async def send_chunks(stream: trio.abc.SendStream, chunks: Sequence[bytes | memoryview]) -> None:
    """Write `chunks` in order; the caller holds the stream's writer lock. What the socket takes at once goes in
    one writev (a control message fits the socket buffer); the rest through send_all."""
    for chunk in _unsent(stream, chunks):
        await stream.send_all(chunk)


def _unsent(stream: trio.abc.SendStream, chunks: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """Write what the socket takes now without waiting; return the rest. Errors are trio's, as send_all raises
    them."""
    if not isinstance(stream, trio.SocketStream) or len(chunks) > WRITEV_CHUNKS:
        return list(chunks)
    try:
        sent = os.writev(_fd(stream), chunks)
    except BlockingIOError:
        return list(chunks)
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
    rest: list[bytes | memoryview] = []
    for chunk in chunks:
        if sent >= len(chunk):
            sent -= len(chunk)
        else:
            rest.append(memoryview(chunk)[sent:] if sent else chunk)
            sent = 0
    return rest
