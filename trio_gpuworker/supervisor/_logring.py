"""Worker stdout/stderr, tagged by stream and generation, capped in size."""

from __future__ import annotations

import logging

log = logging.getLogger("trio_gpuworker.worker_output")


class LogRing:
    """Keeps the last `capacity` bytes of tagged lines; `tail(n)` is attached to engine_crashed."""

    def __init__(self, lane_id: str, capacity: int = 64 * 1024, max_line: int = 4096) -> None:
        self.lane_id = lane_id
        self.capacity = capacity
        self.max_line = max_line
        self._buf = bytearray()
        self._partial: dict[str, bytearray] = {}
        self.dropped = 0

    def feed(self, stream: str, generation: int, data: bytes) -> None:
        """Append a chunk read from a pipe; lines are tagged once complete (or when over max_line)."""
        part = self._partial.setdefault(stream, bytearray())
        part += data
        while True:
            nl = part.find(b"\n")
            if nl < 0 and len(part) < self.max_line:
                break
            cut = nl + 1 if 0 <= nl < self.max_line else self.max_line
            self._append(stream, generation, bytes(part[:cut]).rstrip(b"\n"))
            del part[:cut]

    def flush(self, stream: str, generation: int) -> None:
        part = self._partial.pop(stream, None)
        if part:
            self._append(stream, generation, bytes(part))

    def _append(self, stream: str, generation: int, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        log.info("%s", text, extra={"lane_id": self.lane_id, "generation": generation, "stream": stream})
        self._buf += f"[{self.lane_id} g{generation} {stream}] ".encode() + line + b"\n"
        excess = len(self._buf) - self.capacity
        if excess > 0:
            del self._buf[:excess]
            self.dropped += excess

    def tail(self, n: int) -> str:
        return bytes(self._buf[-n:]).decode("utf-8", "replace") if n > 0 else ""
