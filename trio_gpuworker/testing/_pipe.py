"""A bounded in-memory byte stream pair, standing in for a worker's Unix socket: a writer blocks once `capacity`
bytes wait unread, as on a full socket buffer, so a worker that stops reading stalls the daemon's write."""

from __future__ import annotations

import trio

CAPACITY = 256 * 1024


class _End(trio.abc.HalfCloseableStream):
    def __init__(self, inbox: _Buffer, outbox: _Buffer) -> None:
        self._in, self._out = inbox, outbox

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._out.write(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._in.read(max_bytes or 65536)

    async def send_eof(self) -> None:
        self._out.close()

    async def aclose(self) -> None:
        self._out.close()
        self._in.close()
        await trio.lowlevel.checkpoint()


class _Buffer:
    def __init__(self, capacity: int) -> None:
        self.data = bytearray()
        self.capacity = capacity
        self.closed = False
        self._changed = trio.Event()

    def _kick(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.closed:
                raise trio.BrokenResourceError("the other end is closed")
            room = self.capacity - len(self.data)
            if room <= 0:
                await self._changed.wait()
                continue
            self.data += view[:room]
            view = view[room:]
            self._kick()
        await trio.lowlevel.checkpoint()

    async def read(self, max_bytes: int) -> bytes:
        while not self.data:
            if self.closed:
                return b""
            await self._changed.wait()
        out = bytes(self.data[:max_bytes])
        del self.data[:max_bytes]
        self._kick()
        return out

    def close(self) -> None:
        self.closed = True
        self._kick()


def pipe_pair(capacity: int = CAPACITY) -> tuple[trio.abc.HalfCloseableStream, trio.abc.HalfCloseableStream]:
    """(daemon end, worker end)."""
    a, b = _Buffer(capacity), _Buffer(capacity)
    return _End(a, b), _End(b, a)
