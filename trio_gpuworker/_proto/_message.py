"""A decoded control message: its type, its fields and the raw frame that followed it, if any."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
