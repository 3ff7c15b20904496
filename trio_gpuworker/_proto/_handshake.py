"""HELLO v3 acceptance rules (daemon side) and the worker's HELLO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import HandshakeError, NonceMismatch, PidMismatch, RingAbiMismatch, VersionMismatch
from ._connection import Message
from ._schema import PROTOCOL_VERSION

RING_ABI = 2
MIN_MAX_FRAME = 4096  # below this even a control map may not fit  # the ring header ABI version of ARCHITECTURE §6


@dataclass(frozen=True)
class HandshakeRules:
    nonce: str
    pid: int
    max_frame: int
    generation: int
    ring_abis: frozenset[int] = frozenset({RING_ABI})

    def check_hello(self, hello: Message) -> dict[str, Any]:
        """Validate a HELLO; return the HELLO_ACK fields. Order: version, nonce, pid, ring ABI."""
        if hello["v"] != PROTOCOL_VERSION:
            raise VersionMismatch(f"worker speaks protocol v{hello['v']}, this daemon only v{PROTOCOL_VERSION}")
        if hello["nonce"] != self.nonce:
            raise NonceMismatch("HELLO nonce does not match the spawn nonce (stale or foreign worker)")
        if hello["pid"] != self.pid:
            raise PidMismatch(f"HELLO pid {hello['pid']} is not the spawned pid {self.pid}")
        if hello["max_frame"] < MIN_MAX_FRAME:
            raise HandshakeError(f"HELLO max_frame {hello['max_frame']} is below the floor of {MIN_MAX_FRAME} bytes")
        if hello["ring_abi"] not in self.ring_abis:
            raise RingAbiMismatch(f"ring ABI {hello['ring_abi']} unsupported (supported {sorted(self.ring_abis)})")
        return {"v": PROTOCOL_VERSION, "accept": True, "max_frame": min(self.max_frame, hello["max_frame"]),
                "generation": self.generation}


def hello_fields(nonce: str, pid: int, max_frame: int, engine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "nonce": nonce, "engine": engine, "pid": pid, "max_frame": max_frame,
            "ring_abi": RING_ABI, **extra}
