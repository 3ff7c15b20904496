"""The control connection as a pure state machine: bytes in, events out; messages in, bytes out."""

from __future__ import annotations

import io
from typing import Any

import cbor2

from .._errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedMessage,
    ProtocolError,
    TruncatedStream,
    UnexpectedFrame,
)
from ._framing import DEFAULT_MAX_FRAME, FrameDecoder, frame_prefix
from ._handshake import HANDSHAKE_MESSAGES, Handshake
from ._schema import BOTH, DAEMON, MESSAGES, SCHEMAS, WORKER, check_fields
from ._wire import WireMessage

__all__ = ["CLOSED", "NEED_DATA", "Connection", "check_fields", "decode", "decode_control"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA = _Sentinel("NEED_DATA")
CLOSED = _Sentinel("CLOSED")  # the peer closed its end cleanly between frames


def decode_control(payload: bytes) -> dict[str, Any]:
    """CBOR map with a string "t"; trailing bytes inside the frame are malformed."""
    fp = io.BytesIO(payload)
    try:
        obj = cbor2.CBORDecoder(fp).decode()
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        raise MalformedMessage(f"control frame is not valid CBOR: {exc}") from exc
    if fp.tell() != len(payload):
        raise MalformedMessage(f"{len(payload) - fp.tell()} trailing bytes after the CBOR map")
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise MalformedMessage("control frame is not a CBOR map with string keys")
    t = obj.get("t")
    if not isinstance(t, str):
        raise MalformedMessage("control map has no string field 't'")
    return obj


def decode(t: str, fields: dict[str, Any], raw: bytes | None = None) -> WireMessage:
    """The class of message `t` built from a control map that passed its schema (keys a non-exact message does not
    declare, a newer peer's additions, are dropped)."""
    cls = MESSAGES.get(t)
    if cls is None:
        raise MalformedMessage(f"unknown message type {t!r}")
    return cls.from_fields(fields, raw)


class Connection:
    """One side of a worker control connection.

    `our_role` is DAEMON or WORKER. Which message may travel when during the handshake is the table in
    _handshake.py; `handshake` holds the state. After any remote fault the connection is dead and every
    call raises the same error.
    """

    def __init__(self, our_role: str, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        assert our_role in (DAEMON, WORKER)
        self.our_role = our_role
        self.peer_role = WORKER if our_role == DAEMON else DAEMON
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self._pending: dict[str, Any] | None = None  # control map waiting for its raw frame
        self._eof = False
        self._error: ProtocolError | None = None
        self.handshake = Handshake(our_role, max_frame)

    @property
    def handshake_done(self) -> bool:
        return self.handshake.done

    # --- receiving -------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes read from the socket; b"" means the peer closed its end."""
        self._raise_if_dead()
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("data after EOF")
        self._fail_on(self._decoder.feed, data)

    def next_event(self) -> WireMessage | _Sentinel:
        """The next message, as its class; NEED_DATA or CLOSED."""
        self._raise_if_dead()
        return self._fail_on(self._next_event)

    @property
    def mid_frame(self) -> bool:
        """True when a partial frame or a control map without its raw frame is buffered."""
        return self._decoder.buffered > 0 or self._pending is not None

    def _next_event(self) -> WireMessage | _Sentinel:
        payload = self._decoder.next_frame()
        if payload is None:
            if self._eof:
                if self.mid_frame:
                    raise TruncatedStream("peer closed the connection in the middle of a frame")
                return CLOSED
            return NEED_DATA
        if self._pending is not None:
            fields, self._pending = self._pending, None
            if len(payload) != fields["raw_len"]:
                raise UnexpectedFrame(
                    f"{fields['t']}: raw frame of {len(payload)} bytes, raw_len said {fields['raw_len']}")
            return decode(fields["t"], fields, payload)
        fields = decode_control(payload)
        t = fields["t"]
        self.handshake.receive(t, fields)
        if t in HANDSHAKE_MESSAGES:
            if t == "HELLO_ACK":
                self.set_max_frame(fields["max_frame"])
            return decode(t, fields)
        spec = check_fields(t, fields, MalformedMessage)
        if spec.sender not in (self.peer_role, BOTH):
            raise UnexpectedFrame(f"{t} may not be sent by the {self.peer_role}")
        if spec.raw:
            if fields["raw_len"] > self.max_frame:
                raise FrameTooLarge(f"{t}: raw_len {fields['raw_len']} exceeds max_frame {self.max_frame}")
            self._pending = fields
            return self._next_event()
        return decode(t, fields)

    # --- sending ---------------------------------------------------------------------------

    def send(self, msg: WireMessage) -> list[bytes | memoryview]:
        """Validate an outgoing message; return the byte chunks to write, in order."""
        return self.send_map(msg.T, msg.to_fields(), msg.payload())

    def send_map(
        self, t: str, fields: dict[str, Any] | None = None, raw: bytes | memoryview | None = None
    ) -> list[bytes | memoryview]:
        """`send` of a control map as it goes on the wire, with the same checks: for a peer that writes what no
        class holds (a test's malformed or unknown message). A message the checks refuse raises
        LocalProtocolError and writes nothing."""
        self._raise_if_dead()
        msg = {**(fields or {}), "t": t}
        spec = SCHEMAS.get(t)
        if spec is None or spec.sender not in (self.our_role, BOTH):
            raise LocalProtocolError(f"the {self.our_role} may not send {t!r}")
        if spec.raw:
            if raw is None:
                raise LocalProtocolError(f"{t} needs a raw frame")
            msg["raw_len"] = len(raw)
        elif raw is not None:
            raise LocalProtocolError(f"{t} carries no raw frame")
        self._fail_on(self.handshake.send, t, msg, self._decoder.buffered)
        if t not in HANDSHAKE_MESSAGES:
            check_fields(t, msg, LocalProtocolError)
        elif t == "HELLO_ACK":
            self.set_max_frame(msg["max_frame"])
        payload = cbor2.dumps(msg)
        chunks: list[bytes | memoryview] = [frame_prefix(len(payload), self.max_frame) + payload]
        if raw is not None:
            chunks.append(frame_prefix(len(raw), self.max_frame))
            chunks.append(raw)
        return chunks

    def set_max_frame(self, max_frame: int) -> None:
        """Apply the negotiated limit (the smaller of both sides')."""
        self.max_frame = max_frame
        self._decoder.max_frame = max_frame

    # --- faults ----------------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail_on(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ProtocolError as exc:
            if not isinstance(exc, LocalProtocolError):
                self._error = exc
            raise
