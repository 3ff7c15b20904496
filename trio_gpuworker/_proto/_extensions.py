"""Negotiated extensions of worker-protocol-v3: what a worker can do beyond the reference, and what a request needs.

A worker advertises each extension as one string in HELLO's `engine.build_flags` (a field v3 already has, whose
values the reference leaves free), so a plain v3 worker advertises none and a plain v3 daemon ignores them. The
daemon sends a field of an extension only to a worker that advertised it; a request that needs one the worker
lacks fails before a byte is written (InvalidRequest, HTTP 400), never silently downgraded.

- STREAM: GENERATE `stream: true`; the worker sends TEXT_DELTA {req_id, text, n_gen} frames before TEXT, each
  renewing the inference window as completed work (n_gen strictly increasing).
- SAMPLING: GENERATE `temperature`, `top_p`, `top_k`, `seed`, `stop` (strings) and `logprobs` (alternatives per
  token, 0..5); TEXT then may carry `logprobs` (one record per generated token).
- LONG: GENERATE `max_tokens` beyond the reference's 64, up to the model's context.
- CANCEL: CANCEL {req_id}, out of band: the worker stops that GENERATE at its next token and answers ERR
  `request_cancelled` (a caller that left, not a fault: no strike).
- PACKED: GENERATE_PACKED {model_ref, steps, join, leave} + ids, answered by TEXTS {seqs, failed?}: concurrent
  generations of one model decoded together in chunks of steps, the sequences kept in the worker between chunks
  (the reference HELLO's `packed` capability, still one request in flight). A worker whose model does not batch
  answers ERR `unsupported_request`; the daemon then generates that model's requests one at a time.
- LOADED_BLOCK: INSTALL_RING `loaded_block: true`; the worker then reports that ingress ring's completions as
  LOADED_BLOCK {ring_id, edge_id, port_id, worker_generation} + a raw frame of four little-endian u64s per object
  (OBJECTS_LOADED's row columns), instead of OBJECTS_LOADED's CBOR rows: no encoding, check or decoding per row.
- PROMPT_LOGPROBS: GENERATE `prompt_logprobs` (alternatives per token, 0..5); TEXT then carries `prompt_logprobs`,
  one record per prompt token after the first ({token, id, logprob, top}: the log probability the model gave it
  after the tokens before it), as vLLM's `echo` with `logprobs` reports the prompt.
- POOLING: EMBED_BATCH `pooling` beyond the reference's `mean` and `cls`: `max` (each dimension's largest value over
  the tokens) and `lasttoken` (the last token's state), as sentence-transformers pools.
- GRAMMAR: GENERATE `grammar` (a field v3 has, which its workers refuse): a Lark grammar in llguidance's dialect
  (which also reads GBNF, and embeds a JSON Schema as `%json {...}`); the worker masks the logits of every step
  with it, greedy and sampled, so the text is a sentence of the grammar or a prefix of one cut by max_tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

STREAM = "gpuworker.stream"
SAMPLING = "gpuworker.sampling"
LONG = "gpuworker.long_generation"
CANCEL = "gpuworker.cancel"
PACKED = "gpuworker.packed_generation"
LOADED_BLOCK = "gpuworker.loaded_block"
POOLING = "gpuworker.pooling"
PROMPT_LOGPROBS = "gpuworker.prompt_logprobs"
GRAMMAR = "gpuworker.grammar"
ALL = (STREAM, SAMPLING, LONG, CANCEL, PACKED, LOADED_BLOCK, POOLING, PROMPT_LOGPROBS, GRAMMAR)

V3_POOLINGS = ("mean", "cls")  # the reference's EMBED_BATCH poolings
MORE_POOLINGS = ("max", "lasttoken")  # the POOLING extension's

V3_MAX_GEN_TOKENS = 64  # the reference's GENERATE limit ("micro-LLM is <= 64 tokens")
PACKED_SLOTS = 4  # GENERATE_PACKED: sequences one batch holds at once
MAX_TOP_LOGPROBS = 5  # GENERATE `logprobs`: alternatives per token, as OpenAI allows for completions
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "logprobs")


class Advertiser(Protocol):
    """What a HELLO (the class in _messages.py, which imports this module) says of its engine."""

    engine: dict[str, Any]


def advertised(hello: Advertiser | None) -> frozenset[str]:
    """The extensions a worker's HELLO advertised (none before HELLO)."""
    if hello is None:
        return frozenset()
    flags = hello.engine["build_flags"]
    return frozenset(f for f in flags if f in ALL)


def required(t: str, fields: Mapping[str, Any]) -> frozenset[str]:
    """The extensions a request with these fields needs its worker to have."""
    if t == "GENERATE_PACKED":
        return frozenset({PACKED})
    if t == "INSTALL_RING":
        return frozenset({LOADED_BLOCK}) if fields.get("loaded_block") else frozenset()
    if t == "EMBED_BATCH":
        return frozenset({POOLING}) if fields.get("pooling") in MORE_POOLINGS else frozenset()
    if t != "GENERATE":
        return frozenset()
    need = set()
    if fields.get("stream"):
        need.add(STREAM)
    if any(k in fields for k in SAMPLING_FIELDS):
        need.add(SAMPLING)
    if fields.get("max_tokens", 0) > V3_MAX_GEN_TOKENS:
        need.add(LONG)
    if fields.get("prompt_logprobs") is not None:
        need.add(PROMPT_LOGPROBS)
    if fields.get("grammar"):
        need.add(GRAMMAR)
    return frozenset(need)


def describe(missing: frozenset[str]) -> str:
    what = {STREAM: "streamed text", SAMPLING: "sampling, stop sequences or logprobs",
            LONG: f"more than {V3_MAX_GEN_TOKENS} new tokens", CANCEL: "cancellation",
            PACKED: "batched generation", LOADED_BLOCK: "binary ingress completions",
            POOLING: f"pooling {' or '.join(MORE_POOLINGS)}", PROMPT_LOGPROBS: "the prompt's logprobs (echo)",
            GRAMMAR: "grammar-constrained decoding (grammar, response_format, tools)"}
    return ", ".join(what[m] for m in sorted(missing))


__all__ = ["ALL", "CANCEL", "GRAMMAR", "LOADED_BLOCK", "LONG", "MAX_TOP_LOGPROBS", "MORE_POOLINGS", "PACKED",
           "PACKED_SLOTS", "POOLING", "PROMPT_LOGPROBS", "SAMPLING", "SAMPLING_FIELDS", "STREAM", "V3_MAX_GEN_TOKENS",
           "V3_POOLINGS", "advertised", "describe", "required"]
