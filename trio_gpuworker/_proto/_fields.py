"""Field checks and the Spec record every message schema is derived into (_wire.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]

DAEMON, WORKER, BOTH = "daemon", "worker", "both"
PROTOCOL_VERSION = 3


def uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


def u32(v: Any) -> bool:
    return uint(v) and v < (1 << 32)


def text(v: Any) -> bool:
    return isinstance(v, str)


def flag(v: Any) -> bool:
    return isinstance(v, bool)


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def mapping(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def one_of(*choices: str) -> Check:
    return lambda v: v in choices


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def record(**fields: Check) -> Check:
    """A nested map with exactly these required fields (extra keys tolerated for forward compatibility)."""
    return lambda v: mapping(v) and all(k in v and c(v[k]) for k, c in fields.items())


def exact_record(**fields: Check) -> Check:
    """A nested map with exactly these fields and no others."""
    return lambda v: record(**fields)(v) and v.keys() == fields.keys()


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


class Spec:
    __slots__ = ("exact", "optional", "raw", "required", "sender")

    def __init__(self, sender: str, required: dict[str, Check], opt: dict[str, Check] | None = None,
                 raw: bool = False, exact: bool = False) -> None:
        self.sender = sender
        self.required = required
        self.optional = opt or {}
        self.raw = raw  # carries raw_len and is followed by exactly one raw frame
        self.exact = exact  # no fields beyond `required` and `optional` (the handshake's exact key sets)
