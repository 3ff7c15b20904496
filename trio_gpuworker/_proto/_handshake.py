"""The HELLO / HELLO_ACK handshake: one transition table, the version check, the daemon's acceptance rules.

Every ordering rule of the handshake is a row of TRANSITIONS; nothing else changes HandshakeState. A pair
missing from the table is a protocol fault: LocalProtocolError when we would send it, UnexpectedFrame when
the peer did. The version is checked here and nowhere else, before any other field (the reference rejects
v2 at HELLO, whatever else that HELLO holds). The field sets are the classes Hello / HelloAck (_messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .._errors import (
    HandshakeError,
    LocalProtocolError,
    MalformedMessage,
    NonceMismatch,
    PidMismatch,
    ProtocolError,
    RingAbiMismatch,
    UnexpectedFrame,
    VersionMismatch,
)
from ._messages import Hello, HelloAck
from ._schema import DAEMON, PROTOCOL_VERSION, WORKER, check_fields

RING_ABI = 2  # the ring header ABI version (docs/architecture.md, 'Ring header')
MIN_MAX_FRAME = 4096  # below this even a control map may not fit
HANDSHAKE_MESSAGES = frozenset({"HELLO", "HELLO_ACK"})


class HandshakeState(Enum):
    SEND_HELLO = "send_hello"  # worker: connected, HELLO not yet sent
    AWAIT_ACK = "await_ack"  # worker: HELLO sent
    AWAIT_HELLO = "await_hello"  # daemon: accepted, nothing received yet
    SEND_ACK = "send_ack"  # daemon: HELLO received, not yet answered
    DONE = "done"


class Direction(Enum):
    SEND = "send"
    RECEIVE = "receive"


OTHER = "*"  # any message that is not part of the handshake
S, R = Direction.SEND, Direction.RECEIVE
H = HandshakeState

# (our role, state, direction, message) -> next state. Worker-protocol-v3: the worker sends HELLO first;
# the module answers HELLO_ACK or closes; anything else before HELLO_ACK is a protocol violation.
TRANSITIONS: dict[tuple[str, HandshakeState, Direction, str], HandshakeState] = {
    (WORKER, H.SEND_HELLO, S, "HELLO"): H.AWAIT_ACK,
    (WORKER, H.AWAIT_ACK, R, "HELLO_ACK"): H.DONE,
    (DAEMON, H.AWAIT_HELLO, R, "HELLO"): H.SEND_ACK,
    (DAEMON, H.SEND_ACK, S, "HELLO_ACK"): H.DONE,
    (WORKER, H.DONE, S, OTHER): H.DONE,
    (WORKER, H.DONE, R, OTHER): H.DONE,
    (DAEMON, H.DONE, S, OTHER): H.DONE,
    (DAEMON, H.DONE, R, OTHER): H.DONE,
}
INITIAL = {WORKER: H.SEND_HELLO, DAEMON: H.AWAIT_HELLO}


class Handshake:
    """Where one side of a connection is in the handshake. Pure: fed message types and fields."""

    def __init__(self, our_role: str, max_frame: int) -> None:
        self.our_role = our_role
        self.max_frame = max_frame  # ours; a HELLO_ACK may lower it, never raise it
        self.state = INITIAL[our_role]

    @property
    def done(self) -> bool:
        return self.state is H.DONE

    def send(self, t: str, fields: dict[str, Any], peer_bytes_waiting: int = 0) -> None:
        """Check an outgoing message against the table (and a handshake message's fields); advance.

        `peer_bytes_waiting`: received bytes not yet decoded. When the daemon answers HELLO, any such byte
        was sent right behind HELLO, before HELLO_ACK: a protocol fault, never the first request.
        """
        if self.state is H.SEND_ACK and peer_bytes_waiting:
            raise UnexpectedFrame(f"the worker sent {peer_bytes_waiting} bytes behind HELLO, before HELLO_ACK")
        self._advance(S, t, fields, LocalProtocolError, LocalProtocolError)

    def receive(self, t: str, fields: dict[str, Any]) -> None:
        """Check an incoming message against the table (and a handshake message's fields); advance."""
        self._advance(R, t, fields, UnexpectedFrame, MalformedMessage)
        if t == "HELLO_ACK":
            if fields["accept"] is not True:
                raise HandshakeError("the daemon refused our HELLO")
            if fields["max_frame"] > self.max_frame:
                raise HandshakeError(f"HELLO_ACK max_frame {fields['max_frame']} exceeds ours {self.max_frame}")

    def _advance(self, direction: Direction, t: str, fields: dict[str, Any], order_error: type[ProtocolError],
                 field_error: type[ProtocolError]) -> None:
        kind = t if t in HANDSHAKE_MESSAGES else OTHER
        next_state = TRANSITIONS.get((self.our_role, self.state, direction, kind))
        if next_state is None:
            verb = "send" if direction is S else "receive"
            when = "before the handshake completed" if kind == OTHER else "at this point of the handshake"
            raise order_error(f"the {self.our_role} cannot {verb} {t} {when} (state {self.state.value})")
        if kind != OTHER:
            if fields.get("v") != PROTOCOL_VERSION:
                if direction is S:
                    raise LocalProtocolError(f"{t} must carry v {PROTOCOL_VERSION}, not {fields.get('v')!r}")
                raise VersionMismatch(f"peer speaks protocol v{fields.get('v')!r}, we only v{PROTOCOL_VERSION}")
            check_fields(t, fields, field_error)
        self.state = next_state


@dataclass(frozen=True)
class HandshakeRules:
    """The daemon's acceptance of a HELLO that already passed the Handshake (so its version and fields)."""

    nonce: str
    pid: int
    max_frame: int
    generation: int
    ring_abis: frozenset[int] = frozenset({RING_ABI})

    def check_hello(self, hello: Hello) -> HelloAck:
        """The HELLO_ACK that accepts `hello`. Order: nonce, pid, max_frame floor, ring ABI."""
        if hello.nonce != self.nonce:
            raise NonceMismatch("HELLO nonce does not match the spawn nonce (stale or foreign worker)")
        if hello.pid != self.pid:
            raise PidMismatch(f"HELLO pid {hello.pid} is not the spawned pid {self.pid}")
        if hello.max_frame < MIN_MAX_FRAME:
            raise HandshakeError(f"HELLO max_frame {hello.max_frame} is below the floor of {MIN_MAX_FRAME} bytes")
        if hello.ring_abi not in self.ring_abis:
            raise RingAbiMismatch(f"ring ABI {hello.ring_abi} unsupported (supported {sorted(self.ring_abis)})")
        return HelloAck(v=PROTOCOL_VERSION, accept=True, max_frame=min(self.max_frame, hello.max_frame),
                        generation=self.generation)


def hello_fields(nonce: str, pid: int, max_frame: int, engine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "nonce": nonce, "engine": engine, "pid": pid, "max_frame": max_frame,
            "ring_abi": RING_ABI, **extra}
