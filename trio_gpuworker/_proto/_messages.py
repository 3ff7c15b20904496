"""The control plane of worker-protocol-v3: one frozen dataclass per message (the data plane's are in
_ring_messages.py). A class is the message's whole declaration: sender, fields, checks, which requests it ends;
_schema.py derives the tables from these. Field order is wire order: required fields first, as before.
"""

from __future__ import annotations

from typing import Any

from ._extensions import MORE_POOLINGS, V3_POOLINGS
from ._fields import (
    BOTH,
    DAEMON,
    WORKER,
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
from ._wire import WireMessage, collect, message, need, numbered, opt, raw_frame

ENGINE = exact_record(engine=text, version=text, build_flags=list_of(text))
ITEM = record(id=uint, n_tokens=uint)
# GENERATE_PACKED: a sequence that joins (its sampling fields are GENERATE's, optional), and one's chunk result
JOINING = record(seq=uint, n_tokens=uint, max_tokens=uint)
SEQ_RESULT = record(seq=uint, text=text, n_gen=uint, ids=list_of(uint),
                    finish_reason=optional(one_of("stop", "length")))
CANDIDATE = record(n_tokens=uint)
PHASES = ("setup", "inference", "control")
POOLINGS = V3_POOLINGS + MORE_POOLINGS  # the last two only to a worker with the POOLING extension (_extensions.py)
STOP_MODES = ("graceful", "abort_in_flight")
TEXT = text  # inside a class with a field named `text`, that name is the field


# --- handshake: exact key sets of worker-protocol-v3 (ring_abi and generation are this project's additions,
# docs/architecture.md, 'Handshake');
# `v` is checked by _handshake.py alone, before these

@message("HELLO", WORKER, exact=True)
class Hello(WireMessage):
    v: int = need(uint)
    nonce: str = need(text)
    engine: dict[str, Any] = need(ENGINE)
    pid: int = need(uint)
    max_frame: int = need(u32)
    ring_abi: int = need(uint)
    manifest_digest: str | None = opt(text)
    kernel_revision: str | None = opt(text)
    packed: bool | None = opt(flag)


@message("HELLO_ACK", DAEMON, exact=True)
class HelloAck(WireMessage):
    v: int = need(uint)
    accept: bool = need(flag)
    max_frame: int = need(u32)
    generation: int = need(uint)


# --- requests

@message("LOAD", DAEMON)
class Load(WireMessage):
    req_id: int = numbered()
    artifact_path: str = need(text)
    artifact_digest: str = need(text)
    format: str = need(text)
    runtime_config: dict[str, Any] = need(mapping)
    model_ref: str | None = opt(text)


@message("EMBED_BATCH", DAEMON, serves=True)
class EmbedBatch(WireMessage):
    req_id: int = numbered()
    model_ref: str = need(text)
    pooling: str = need(one_of(*POOLINGS))
    normalize: bool = need(flag)
    items: list[dict[str, Any]] = need(list_of(ITEM))
    raw: bytes = raw_frame()  # the items' token ids, int32 LE, back to back


@message("RERANK", DAEMON, serves=True)
class Rerank(WireMessage):
    req_id: int = numbered()
    model_ref: str = need(text)
    query_n_tokens: int = need(uint)
    candidates: list[dict[str, Any]] = need(list_of(CANDIDATE))
    raw: bytes = raw_frame()  # the query's ids, then each candidate's


# the optional fields past `grammar` are negotiated extensions (_extensions.py): sent only to a worker that
# advertised them. The daemon has always written grammar and stream after them: `last` keeps those bytes.
@message("GENERATE", DAEMON, serves=True, last=("grammar", "stream"))
class Generate(WireMessage):
    req_id: int = numbered()
    model_ref: str = need(text)
    max_tokens: int = need(uint)
    grammar: str | None = opt(optional(text))
    stream: bool | None = opt(flag)
    temperature: float | None = opt(number)
    top_p: float | None = opt(number)
    top_k: int | None = opt(uint)
    seed: int | None = opt(uint)
    stop: list[str] | None = opt(list_of(text))
    logprobs: int | None = opt(uint)
    prompt_logprobs: int | None = opt(uint)  # the PROMPT_LOGPROBS extension
    raw: bytes = raw_frame()  # the prompt's ids


# the PACKED extension (_extensions.py): one chunk of a batch of sequences decoded together. The worker keeps each
# sequence (its KV cache slot, sampler, stop strings) between chunks: the ones in `join` are prefilled and start,
# the ones in `leave` are dropped (their callers left), then every live one advances up to `steps` tokens. Any
# ERR ends every sequence of the model's batch on both sides.
@message("GENERATE_PACKED", DAEMON, serves=True)
class GeneratePacked(WireMessage):
    req_id: int = numbered()
    model_ref: str = need(text)
    steps: int = need(uint)
    join: list[dict[str, Any]] = need(list_of(JOINING))
    leave: list[int] = need(list_of(uint))
    live: list[int] = need(list_of(uint))  # the daemon's sequences going on past `leave`: the worker's must match
    raw: bytes = raw_frame()  # the joining sequences' prompt ids, int32 LE, in `join` order


@message("UNLOAD", DAEMON)
class Unload(WireMessage):
    req_id: int = numbered()
    model_ref: str = need(text)


@message("PING", DAEMON)
class Ping(WireMessage):
    req_id: int = numbered()


# without req_id: out of band, past a request in flight (abort_in_flight); WORKER_STOPPED then has none
@message("SHUTDOWN", DAEMON)
class Shutdown(WireMessage):
    req_id: int | None = opt(uint)
    mode: str | None = opt(one_of(*STOP_MODES))


# out of band too (the CANCEL extension): stop that GENERATE; it ends with ERR request_cancelled
@message("CANCEL", DAEMON)
class Cancel(WireMessage):
    req_id: int = need(uint)


# --- replies

@message("LOADED", WORKER, ends=(Load,))
class Loaded(WireMessage):
    req_id: int = need(uint)
    model_ref: str = need(text)
    dims: int = need(uint)
    cold_load_ms: float = need(number)


@message("VECTORS", WORKER, ends=(EmbedBatch,))
class Vectors(WireMessage):
    req_id: int = need(uint)
    dims: int = need(uint)
    n: int = need(uint)
    raw: bytes = raw_frame()  # n x dims float32 LE


@message("SCORES", WORKER, ends=(Rerank,))
class Scores(WireMessage):
    req_id: int = need(uint)
    n: int = need(uint)
    method: str | None = opt(text)
    raw: bytes = raw_frame()  # n float32 LE


@message("TEXT", WORKER, ends=(Generate,))
class Text(WireMessage):
    req_id: int = need(uint)
    text: str = need(TEXT)
    n_prompt: int = need(uint)
    n_gen: int = need(uint)
    finish_reason: str = need(one_of("stop", "length"))
    logprobs: list[dict[str, Any]] | None = opt(list_of(mapping))
    prompt_logprobs: list[dict[str, Any]] | None = opt(list_of(mapping))  # per prompt token after the first
    raw: bytes = raw_frame()  # the generated ids


# the STREAM extension: text generated so far past the previous delta, before TEXT
@message("TEXT_DELTA", WORKER)
class TextDelta(WireMessage):
    req_id: int = need(uint)
    text: str = need(TEXT)
    n_gen: int = need(uint)
    logprobs: list[dict[str, Any]] | None = opt(list_of(mapping))


# each live (or just finished) sequence's chunk: its new final text and ids, n_gen so far, and finish_reason once
# it ended (then the worker has dropped it); `failed` names joining sequences refused, with why
@message("TEXTS", WORKER, ends=(GeneratePacked,))
class Texts(WireMessage):
    req_id: int = need(uint)
    seqs: list[dict[str, Any]] = need(list_of(SEQ_RESULT))
    failed: list[dict[str, Any]] | None = opt(list_of(record(seq=uint, code=text, msg=text)))


@message("UNLOADED", WORKER, ends=(Unload,))
class Unloaded(WireMessage):
    req_id: int = need(uint)


@message("PONG", WORKER, ends=(Ping,))
class Pong(WireMessage):
    req_id: int = need(uint)
    rss_mb: float = need(number)
    models_loaded: list[str] = need(list_of(text))
    placement_share: float | None = opt(number)


@message("WORKER_STOPPED", WORKER, ends=(Shutdown,))
class WorkerStopped(WireMessage):
    reason: str = need(one_of(*STOP_MODES, "fatal"))
    req_id: int | None = opt(uint)


# ends any request; _requests.py knows it by name, so it is listed under no request
@message("ERR", WORKER, fails=True)
class Err(WireMessage):
    req_id: int = need(uint)
    code: str = need(text)
    msg: str = need(text)


@message("PROGRESS", WORKER)
class Progress(WireMessage):
    req_id: int = need(uint)
    completed: int = need(uint)
    phase: str = need(one_of(*PHASES))


@message("WORKER_FATAL", WORKER)
class WorkerFatal(WireMessage):
    reason: str = need(text)
    msg: str | None = opt(text)


# --- wake hints, either way

@message("RING_READABLE", BOTH, hint=True)
class RingReadable(WireMessage):
    ring_id: int = need(uint)


@message("RING_WRITABLE", BOTH, hint=True)
class RingWritable(WireMessage):
    ring_id: int = need(uint)


CONTROL_MESSAGES = collect(globals())
