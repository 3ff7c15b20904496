"""u32 little-endian length-prefixed frames, decoded incrementally."""

from __future__ import annotations

import struct

from .._errors import FrameTooLarge, OutgoingFrameTooLarge

LENGTH = struct.Struct("<I")
PREFIX_LEN = LENGTH.size
DEFAULT_MAX_FRAME = 64 << 20


def encode_frame(payload: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    n = len(payload)
    if n > max_frame:
        raise OutgoingFrameTooLarge(f"frame of {n} bytes exceeds max_frame {max_frame}")
    return LENGTH.pack(n) + bytes(payload)


def frame_prefix(n: int, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """The length prefix alone, for writing a large payload without concatenating it."""
    if n > max_frame:
        raise OutgoingFrameTooLarge(f"frame of {n} bytes exceeds max_frame {max_frame}")
    return LENGTH.pack(n)


class FrameDecoder:
    """Feed bytes with `feed`; take complete payloads with `next_frame` (None when more is needed).

    The length is checked against `max_frame` as soon as its 4 bytes are in, before the payload
    is buffered, so an oversized length costs nothing. After a fault every call fails fast.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        self._error: FrameTooLarge | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | None:
        if self._error is not None:
            raise self._error
        if self.buffered < PREFIX_LEN:
            return None
        (n,) = LENGTH.unpack_from(self._buf, self._pos)
        if n > self.max_frame:
            self._error = FrameTooLarge(f"frame length {n} exceeds max_frame {self.max_frame}")
            raise self._error
        end = self._pos + PREFIX_LEN + n
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[self._pos + PREFIX_LEN : end])
        self._pos = end
        return payload

    def pending_frame_bytes(self) -> int:
        """Bytes still missing for the frame being assembled (0 when none is started or it is whole)."""
        if self.buffered < PREFIX_LEN:
            return 0
        (n,) = LENGTH.unpack_from(self._buf, self._pos)
        return max(0, PREFIX_LEN + n - self.buffered)
