"""Per-message schemas: which side may send each message and the type of every field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]

DAEMON, WORKER, BOTH = "daemon", "worker", "both"
PROTOCOL_VERSION = 3


def uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


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


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


ENGINE = record(engine=text, version=text)
ITEM = record(id=uint, n_tokens=uint)
CANDIDATE = record(n_tokens=uint)
PHASES = ("setup", "inference", "control")
POOLINGS = ("mean", "cls")


class Spec:
    __slots__ = ("optional", "raw", "required", "sender")

    def __init__(self, sender: str, required: dict[str, Check], opt: dict[str, Check] | None = None,
                 raw: bool = False) -> None:
        self.sender = sender
        self.required = required
        self.optional = opt or {}
        self.raw = raw  # carries raw_len and is followed by exactly one raw frame


REQ = {"req_id": uint}

SCHEMAS: dict[str, Spec] = {
    # handshake
    "HELLO": Spec(WORKER, {"v": uint, "nonce": text, "engine": ENGINE, "pid": uint, "max_frame": uint,
                           "ring_abi": uint},
                  {"manifest_digest": text, "kernel_revision": text, "packed": flag}),
    "HELLO_ACK": Spec(DAEMON, {"v": uint, "accept": flag, "max_frame": uint, "generation": uint}),
    # requests
    "LOAD": Spec(DAEMON, {**REQ, "artifact_path": text, "artifact_digest": text, "format": text,
                          "runtime_config": mapping}, {"model_ref": text}),
    "EMBED_BATCH": Spec(DAEMON, {**REQ, "model_ref": text, "pooling": one_of(*POOLINGS), "normalize": flag,
                                 "items": list_of(ITEM)}, raw=True),
    "RERANK": Spec(DAEMON, {**REQ, "model_ref": text, "query_n_tokens": uint,
                            "candidates": list_of(CANDIDATE)}, raw=True),
    "GENERATE": Spec(DAEMON, {**REQ, "model_ref": text, "max_tokens": uint}, {"grammar": optional(text)},
                     raw=True),
    "UNLOAD": Spec(DAEMON, {**REQ, "model_ref": text}),
    "PING": Spec(DAEMON, REQ),
    "SHUTDOWN": Spec(DAEMON, REQ, {"mode": one_of("graceful", "abort_in_flight")}),
    # replies
    "LOADED": Spec(WORKER, {**REQ, "model_ref": text, "dims": uint, "cold_load_ms": number}),
    "VECTORS": Spec(WORKER, {**REQ, "dims": uint, "n": uint}, raw=True),
    "SCORES": Spec(WORKER, {**REQ, "n": uint}, {"method": text}, raw=True),
    "TEXT": Spec(WORKER, {**REQ, "text": text, "n_prompt": uint, "n_gen": uint,
                          "finish_reason": one_of("stop", "length")}, raw=True),
    "UNLOADED": Spec(WORKER, REQ),
    "PONG": Spec(WORKER, {**REQ, "rss_mb": number, "models_loaded": list_of(text)},
                 {"placement_share": number}),
    "WORKER_STOPPED": Spec(WORKER, {"reason": one_of("graceful", "abort_in_flight", "fatal")},
                           {"req_id": uint}),
    "ERR": Spec(WORKER, {**REQ, "code": text, "msg": text}),
    "PROGRESS": Spec(WORKER, {**REQ, "completed": uint, "phase": one_of(*PHASES)}),
    "WORKER_FATAL": Spec(WORKER, {"reason": text}, {"msg": text}),
    # wake hints, either way
    "RING_READABLE": Spec(BOTH, {"ring_id": uint}),
    "RING_WRITABLE": Spec(BOTH, {"ring_id": uint}),
}

# Terminal replies that end a request (ERR ends any request).
TERMINAL = {
    "LOAD": {"LOADED"},
    "EMBED_BATCH": {"VECTORS"},
    "RERANK": {"SCORES"},
    "GENERATE": {"TEXT"},
    "UNLOAD": {"UNLOADED"},
    "PING": {"PONG"},
    "SHUTDOWN": {"WORKER_STOPPED"},
}


def register(name: str, spec: Spec, terminal_for: dict[str, set[str]] | None = None) -> None:
    """Extensions (the ring control surface) add their messages here at import time."""
    SCHEMAS[name] = spec
    for req, replies in (terminal_for or {}).items():
        TERMINAL.setdefault(req, set()).update(replies)
