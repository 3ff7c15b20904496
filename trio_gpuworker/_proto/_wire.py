"""How a wire message is declared: one frozen dataclass whose fields, checks and class options are its schema.

h11's `_events.py` is the model. A message class is written once, with the `message` decorator:

    @message("UNLOAD", DAEMON)
    class Unload(WireMessage):
        req_id: int = numbered()
        model_ref: str = need(text)

`need(check)` is a required field, `opt(check)` an optional one (None: absent from the map), `numbered()` a
request's req_id (required on the wire, filled in by the lane that sends it, so a request is built without
one, and written after the other fields: the bytes every worker has always been sent), `raw_frame()` the raw
frame that follows the control map. `ends=` names the requests a reply is terminal
for, `precedes=` those it is an intermediate reply of, `serves=True` marks a request that serves a caller (its
success clears the lane's strikes), `hint=True` a wake-up hint that is never a reply, `fails=True` a reply saying
its request failed (it clears no strike), `last=` fields a sender has always written after the others.
Everything else, the schemas, TERMINAL, INTERMEDIATE, SERVING and the sender
direction, is derived from the classes (_schema.py); nothing registers itself anywhere at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from ._fields import BOTH, DAEMON, WORKER, Check, Spec, uint

_CHECK, _OPTIONAL, _RAW, _NUMBERED = "check", "optional", "raw", "numbered"
W = TypeVar("W", bound="WireMessage")


def need(check: Check) -> Any:
    """A required field whose value passes `check`."""
    return dataclasses.field(metadata={_CHECK: check})


def opt(check: Check) -> Any:
    """An optional field. None stands for absent: such a field is left out of the map when encoding. (GENERATE's
    `grammar` alone accepts an explicit null; the worker reads a null grammar as none, so that is the same.)"""
    return dataclasses.field(default=None, metadata={_CHECK: check, _OPTIONAL: True})


def numbered() -> Any:
    """A request's req_id: required on the wire, numbered by the connection that sends it (the daemon's
    RequestTracker, in supervisor/_exchange.py), so a request is built without one. None until then; a None
    req_id never passes the schema, so a request sent unnumbered fails before a byte is written. It goes last in
    the control map."""
    return dataclasses.field(default=None, metadata={_CHECK: uint, _NUMBERED: True})


def raw_frame() -> Any:
    """The raw frame after the control map (its `raw_len` is the Connection's business, not a field)."""
    return dataclasses.field(default=b"", metadata={_RAW: True}, repr=False)


class WireMessage:
    """The base of every message class; the class attributes are set by `message`."""

    __slots__ = ()
    T: ClassVar[str]  # the wire name, the control map's "t"
    SENDER: ClassVar[str]  # DAEMON, WORKER or BOTH
    EXACT: ClassVar[bool]  # no keys beyond the declared fields (the handshake's exact key sets)
    ENDS: ClassVar[tuple[type[WireMessage], ...]]  # the requests this reply is terminal for
    PRECEDES: ClassVar[tuple[type[WireMessage], ...]]  # the requests this reply is an intermediate reply of
    SERVES: ClassVar[bool]  # a request that serves a caller: only its success clears strikes
    HINT: ClassVar[bool]  # a wake-up hint (RING_READABLE, RING_WRITABLE): a notification, never a reply
    FAILS: ClassVar[bool]  # a reply saying its request failed (ERR, STEP_FAILED, ...): it clears no strike
    SPEC: ClassVar[Spec]
    _REQUIRED: ClassVar[tuple[str, ...]]
    _OPTIONALS: ClassVar[tuple[str, ...]]
    _NAMES: ClassVar[tuple[tuple[str, bool], ...]]  # (field, optional) in wire order
    RAW: ClassVar[bool]

    def to_fields(self) -> dict[str, Any]:
        """The control map's fields, without "t" and "raw_len", in declaration order (the wire order)."""
        return {name: v for name, optional in self._NAMES if (v := getattr(self, name)) is not None or not optional}

    def payload(self) -> bytes | memoryview | None:
        """The raw frame, or None for a message that carries none."""
        return getattr(self, "raw", None)

    @classmethod
    def from_fields(cls: type[W], fields: Mapping[str, Any], raw: bytes | None = None) -> W:
        """Build from a control map that passed its schema (unknown keys of a non-exact message are dropped)."""
        kwargs = {name: fields[name] for name in cls._REQUIRED}
        kwargs.update((name, fields.get(name)) for name in cls._OPTIONALS)
        if cls.RAW:
            kwargs["raw"] = raw if raw is not None else b""
        return cls(**kwargs)


def message(t: str, sender: str, *, exact: bool = False, ends: tuple[type[WireMessage], ...] = (),
            precedes: tuple[type[WireMessage], ...] = (), serves: bool = False, hint: bool = False,
            fails: bool = False, last: tuple[str, ...] = ()) -> Callable[[type[W]], type[W]]:
    """Make `cls` a frozen, keyword-only dataclass for wire message `t` and derive its schema from its fields.
    `last`: fields written after the others (the order a sender has always used), whatever their declaration
    order; the schema is the same."""
    assert sender in (DAEMON, WORKER, BOTH)

    def wrap(cls: type[W]) -> type[W]:
        dc = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
        required: dict[str, Check] = {}
        optional: dict[str, Check] = {}
        raw = False
        for f in dataclasses.fields(dc):
            if f.metadata.get(_RAW):
                raw = True
            elif f.metadata.get(_OPTIONAL):
                optional[f.name] = f.metadata[_CHECK]
            else:
                required[f.name] = f.metadata[_CHECK]
        dc.T, dc.SENDER, dc.EXACT, dc.RAW, dc.ENDS, dc.PRECEDES = t, sender, exact, raw, ends, precedes
        dc.SERVES, dc.HINT, dc.FAILS = serves, hint, fails
        dc.SPEC = Spec(sender, required, optional, raw=raw, exact=exact)
        dc._REQUIRED, dc._OPTIONALS = tuple(required), tuple(optional)
        names = [f.name for f in dataclasses.fields(dc) if f.name in required or f.name in optional]
        after = (*last, *(f.name for f in dataclasses.fields(dc) if f.metadata.get(_NUMBERED)))
        names = [n for n in names if n not in after] + [n for n in after if n in names]
        dc._NAMES = tuple((name, name in optional) for name in names)
        return dc

    return wrap


def collect(namespace: Mapping[str, Any]) -> tuple[type[WireMessage], ...]:
    """The message classes a module defines, in definition order: its table is derived, never listed by hand."""
    return tuple(v for v in namespace.values() if isinstance(v, type) and issubclass(v, WireMessage)
                 and "T" in vars(v))
