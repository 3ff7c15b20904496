"""The HELLO / HELLO_ACK exchange's builders: a worker's HELLO fields and message, the daemon's acceptance rules, a
Connection fed until it needs data."""

from __future__ import annotations

from typing import Any

from trio_gpuworker._proto import (
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    Connection,
    HandshakeRules,
    Hello,
    WireMessage,
    hello_fields,
)

ENGINE = {"engine": "fake", "version": "1", "build_flags": ["cpu"]}
NONCE = "9f" * 16
PID = 4242
ACK = {"v": 3, "accept": True, "max_frame": DEFAULT_MAX_FRAME, "generation": 1}


def hello(**overrides: Any) -> dict[str, Any]:
    return {**hello_fields(NONCE, PID, DEFAULT_MAX_FRAME, ENGINE), **overrides}


def receive(conn: Connection, data: bytes, bytewise: bool = False) -> list[WireMessage]:
    out: list[WireMessage] = []
    for chunk in [data[i : i + 1] for i in range(len(data))] if bytewise else [data]:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not NEED_DATA:
            assert isinstance(event, WireMessage)
            out.append(event)
    return out


def rules(**overrides: Any) -> HandshakeRules:
    return HandshakeRules(**{"nonce": NONCE, "pid": PID, "max_frame": DEFAULT_MAX_FRAME, "generation": 3,
                             **overrides})


def hello_message(**overrides: Any) -> Hello:
    return Hello(**hello(**overrides))
