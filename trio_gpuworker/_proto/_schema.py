"""The protocol's tables, derived from the message classes (_messages.py, _ring_messages.py): which side may
send each message, the type of every field, and which replies end which request. Nothing here is written by
hand; a new message is a new class.
"""

from __future__ import annotations

from typing import Any

from .._errors import ProtocolError
from ._fields import BOTH, DAEMON, PROTOCOL_VERSION, WORKER, Spec, uint
from ._messages import CONTROL_MESSAGES, PHASES, POOLINGS
from ._ring_messages import RING_MESSAGES
from ._wire import WireMessage

MESSAGES: dict[str, type[WireMessage]] = {cls.T: cls for cls in (*CONTROL_MESSAGES, *RING_MESSAGES)}
SCHEMAS: dict[str, Spec] = {t: cls.SPEC for t, cls in MESSAGES.items()}


def _by_request(attr: str) -> dict[str, set[str]]:
    """Each request mapped to the replies whose class names it under `attr` (ENDS or PRECEDES)."""
    table: dict[str, set[str]] = {}
    for cls in MESSAGES.values():
        for req in getattr(cls, attr):
            table.setdefault(req.T, set()).add(cls.T)
    return table


TERMINAL = _by_request("ENDS")  # every request and the replies that end it (ERR ends any request)
SERVING = frozenset(t for t, cls in MESSAGES.items() if cls.SERVES)  # requests whose success clears strikes
INTERMEDIATE = _by_request("PRECEDES")  # replies that precede the terminal one (OBJECT_PRODUCED of EXECUTE_STEP)
assert len(MESSAGES) == len(CONTROL_MESSAGES) + len(RING_MESSAGES), "two message classes share a wire name"


def check_fields(t: str, fields: dict[str, Any], error: type[ProtocolError]) -> Spec:
    """Validate a control map (with its "t") against its schema; raise `error` naming the first bad field."""
    spec = SCHEMAS.get(t)
    if spec is None:
        raise error(f"unknown message type {t!r}")
    for name, check in spec.required.items():
        if name not in fields:
            raise error(f"{t}: missing field {name!r}")
        if not check(fields[name]):
            raise error(f"{t}: field {name!r} has a bad value {fields[name]!r:.80}")
    for name, check in spec.optional.items():
        if name in fields and not check(fields[name]):
            raise error(f"{t}: field {name!r} has a bad value {fields[name]!r:.80}")
    if spec.raw and not uint(fields.get("raw_len")):
        raise error(f"{t}: missing or bad raw_len")
    if spec.exact and (extra := fields.keys() - spec.required.keys() - spec.optional.keys() - {"t"}):
        raise error(f"{t}: unexpected fields {sorted(extra)}")
    return spec


__all__ = ["BOTH", "DAEMON", "INTERMEDIATE", "MESSAGES", "PHASES", "POOLINGS", "PROTOCOL_VERSION",
           "SCHEMAS", "SERVING", "TERMINAL", "WORKER", "Spec", "WireMessage", "check_fields"]
