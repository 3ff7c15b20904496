"""Per-message schemas: which side may send each message and the type of every field.

The whole protocol is declared here once; the data-plane messages come from _ring_messages as plain
tables, merged below, so importing a module never changes another module's tables.
"""

from __future__ import annotations

from typing import Any

from .._errors import ProtocolError
from ._fields import (
    BOTH,
    DAEMON,
    PROTOCOL_VERSION,
    REQ,
    WORKER,
    Check,
    Spec,
    exact_record,
    flag,
    list_of,
    mapping,
    number,
    one_of,
    optional,
    record,
    text,
    u32,
    uint,
)
from ._ring_messages import RING_SCHEMAS, RING_TERMINAL

ENGINE = exact_record(engine=text, version=text, build_flags=list_of(text))
ITEM = record(id=uint, n_tokens=uint)
CANDIDATE = record(n_tokens=uint)
PHASES = ("setup", "inference", "control")
POOLINGS = ("mean", "cls")


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
    # the optional fields past `grammar` are negotiated extensions (_extensions.py): sent only to a worker that
    # advertised them
    "GENERATE": Spec(DAEMON, {**REQ, "model_ref": text, "max_tokens": uint},
                     {"grammar": optional(text), "stream": flag, "temperature": number, "top_p": number,
                      "top_k": uint, "seed": uint, "stop": list_of(text), "logprobs": uint}, raw=True),
    "UNLOAD": Spec(DAEMON, {**REQ, "model_ref": text}),
    "PING": Spec(DAEMON, REQ),
    # without req_id: out of band, past a request in flight (abort_in_flight); WORKER_STOPPED then has none
    "SHUTDOWN": Spec(DAEMON, {}, {"req_id": uint, "mode": one_of("graceful", "abort_in_flight")}),
    # out of band too (the CANCEL extension): stop that GENERATE; it ends with ERR request_cancelled
    "CANCEL": Spec(DAEMON, REQ),
    # replies
    "LOADED": Spec(WORKER, {**REQ, "model_ref": text, "dims": uint, "cold_load_ms": number}),
    "VECTORS": Spec(WORKER, {**REQ, "dims": uint, "n": uint}, raw=True),
    "SCORES": Spec(WORKER, {**REQ, "n": uint}, {"method": text}, raw=True),
    "TEXT": Spec(WORKER, {**REQ, "text": text, "n_prompt": uint, "n_gen": uint,
                          "finish_reason": one_of("stop", "length")}, {"logprobs": list_of(mapping)}, raw=True),
    # the STREAM extension: text generated so far past the previous delta, before TEXT
    "TEXT_DELTA": Spec(WORKER, {**REQ, "text": text, "n_gen": uint}, {"logprobs": list_of(mapping)}),
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
    **RING_SCHEMAS,
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
    **RING_TERMINAL,
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


__all__ = ["BOTH", "DAEMON", "PROTOCOL_VERSION", "REQ", "SCHEMAS", "TERMINAL", "WORKER", "Check", "Spec",
           "check_fields", "exact_record", "flag", "list_of", "mapping", "number", "one_of", "optional", "record",
           "text", "u32", "uint"]
