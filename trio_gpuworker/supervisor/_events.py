"""Fan-out of lane events (WORKER_CRASHED, RING_FAULT, ...) to subscribers that never block a lane."""

from __future__ import annotations

from typing import Any

import trio


class EventBus:
    def __init__(self, buffer: int = 256) -> None:
        self._buffer = buffer
        self._subs: list[trio.MemorySendChannel[dict[str, Any]]] = []
        self.dropped = 0

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](self._buffer)
        self._subs.append(send)
        return recv

    def publish(self, event: dict[str, Any]) -> None:
        """Deliver without waiting: a subscriber that stopped reading loses events, the lane does not stall."""
        for send in list(self._subs):
            try:
                send.send_nowait(event)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subs.remove(send)

    def close(self) -> None:
        for send in self._subs:
            send.close()
        self._subs.clear()
