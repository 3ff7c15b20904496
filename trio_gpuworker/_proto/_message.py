"""A decoded control message: its type, its fields and the raw frame that followed it, if any.

`Message` is the untyped view every caller had before the message classes; `typed()` gives the class
(_messages.py, _ring_messages.py) and `Message.of` goes back, so both views describe the same frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import MalformedMessage
from ._schema import MESSAGES
from ._wire import WireMessage


@dataclass(frozen=True, slots=True)
class Message:
    t: str
    fields: dict[str, Any]
    raw: bytes | None = None
    extras: tuple[Message, ...] = ()  # intermediate replies gathered before a terminal one (OBJECT_PRODUCED)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def typed(self) -> WireMessage:
        """This message as its class. The Connection checked the fields already; keys a non-exact message does
        not declare (a newer peer's additions) are not carried over."""
        return decode(self.t, self.fields, self.raw)

    @classmethod
    def of(cls, msg: WireMessage) -> Message:
        """The untyped view of `msg`, as the Connection would have decoded it from its bytes."""
        fields = {**msg.to_fields(), "t": msg.T}
        raw = bytes(msg.raw) if msg.RAW else None
        if raw is not None:
            fields["raw_len"] = len(raw)
        return cls(msg.T, fields, raw)


def decode(t: str, fields: dict[str, Any], raw: bytes | None = None) -> WireMessage:
    """The class of message `t` built from fields that passed its schema."""
    cls = MESSAGES.get(t)
    if cls is None:
        raise MalformedMessage(f"unknown message type {t!r}")
    return cls.from_fields(fields, raw)
