"""Per-message schemas: which side may send each message and the type of every field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import ProtocolError

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


ENGINE = exact_record(engine=text, version=text, build_flags=list_of(text))
ITEM = record(id=uint, n_tokens=uint)
CANDIDATE = record(n_tokens=uint)
PHASES = ("setup", "inference", "control")
POOLINGS = ("mean", "cls")


class Spec:
    __slots__ = ("exact", "optional", "raw", "required", "sender")

    def __init__(self, sender: str, required: dict[str, Check], opt: dict[str, Check] | None = None,
                 raw: bool = False, exact: bool = False) -> None:
        self.sender = sender
        self.required = required
        self.optional = opt or {}
        self.raw = raw  # carries raw_len and is followed by exactly one raw frame
        self.exact = exact  # no fields beyond `required` and `optional` (the handshake's exact key sets)


REQ = {"req_id": uint}

SCHEMAS: dict[str, Spec] = {
    # handshake
    # handshake: exact key sets of worker-protocol-v3 (ring_abi and generation are ARCHITECTURE §3's additions);
    # `v` is checked by _handshake.py alone, before these
    "HELLO": Spec(WORKER, {"v": uint, "nonce": text, "engine": ENGINE, "pid": uint, "max_frame": u32,
                           "ring_abi": uint},
                  {"manifest_digest": text, "kernel_revision": text, "packed": flag}, exact=True),
    "HELLO_ACK": Spec(DAEMON, {"v": uint, "accept": flag, "max_frame": u32, "generation": uint}, exact=True),
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


def register(name: str, spec: Spec, terminal_for: dict[str, set[str]] | None = None) -> None:
    """Extensions (the ring control surface) add their messages here at import time."""
    SCHEMAS[name] = spec
    for req, replies in (terminal_for or {}).items():
        TERMINAL.setdefault(req, set()).update(replies)
