"""Hypothesis fuzzing of every route's body, driven in-process through the ASGI app (no sockets, so a case costs
well under a millisecond) against a daemon with a real fake worker: 0 answers with status 500, 0 strikes.

FUZZ_EXAMPLES cases per route (default 10^4; `make fuzz` runs more). Hypothesis runs in a thread and sends
each case into the daemon's trio loop.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for
from tests.support.http_fuzz import EXAMPLES, JSON, NUMBER, PER_EXAMPLE, RAW, SAMPLING, TEXT, asgi_status, encode

MODELS = st.sampled_from([MODEL, "nope", ""]) | JSON
TEXTS = st.lists(TEXT, min_size=1, max_size=6)
IDS = st.lists(st.integers(-2, 30530) | st.integers(), min_size=0, max_size=8)  # token ids, in range or not
VALID_IDS = st.lists(st.integers(0, 30521), min_size=1, max_size=8)


def shaped(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies close to valid, so the cases reach the handlers' depths: each field right, wrong or absent."""
    return st.fixed_dictionaries({}, optional={k: v | JSON for k, v in fields.items()})


VALID: dict[str, st.SearchStrategy[dict[str, Any]]] = {  # valid but for their texts, which may be anything
    "/v1/embeddings": st.fixed_dictionaries({"model": st.just(MODEL), "input": TEXT | TEXTS},
                                            optional={"encoding_format": st.sampled_from(["float", "base64"])}),
    "/v1/rerank": st.fixed_dictionaries({"model": st.just(MODEL), "query": TEXT, "documents": TEXTS},
                                        optional={"top_n": st.integers(1, 8), "return_documents": st.booleans()}),
    "/v2/rerank": st.fixed_dictionaries({"model": st.just(MODEL), "query": TEXT, "documents": TEXTS},
                                        optional={"top_n": st.integers(1, 8), "max_tokens_per_doc": st.integers(1, 9),
                                                  "truncate": st.booleans()}),
    "/rerank": st.fixed_dictionaries({"query": TEXT, "texts": TEXTS},
                                     optional={"raw_scores": st.booleans(), "return_text": st.booleans(),
                                               "truncate": st.booleans()}),
    "/tokenize": st.fixed_dictionaries({"model": st.just(MODEL), "prompt": TEXT},
                                       optional={"add_special_tokens": st.booleans()}),
    "/detokenize": st.fixed_dictionaries({"model": st.just(MODEL), "tokens": VALID_IDS}),
    "/embed": st.fixed_dictionaries({"inputs": TEXT | TEXTS}, optional={"normalize": st.booleans()}),
}
VALID["/v1/embeddings"] = VALID["/v1/embeddings"] | st.fixed_dictionaries(
    {"model": st.just(MODEL), "input": VALID_IDS | st.lists(VALID_IDS, min_size=1, max_size=4)},
    optional={"truncate": st.booleans(), "normalize": st.booleans()})
BODIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/embeddings": shaped({"model": MODELS, "input": TEXT | TEXTS | IDS | st.lists(IDS, max_size=4),
                              "encoding_format": st.sampled_from(["float", "base64", "int8", None]),
                              "dimensions": st.none() | st.integers(), "truncate": st.booleans(),
                              "normalize": st.booleans(), "pooling": st.sampled_from(["mean", "cls", "max"]),
                              "user": TEXT}),
    "/v1/rerank": shaped({"model": MODELS, "query": TEXT, "documents": TEXTS | st.lists(
        st.fixed_dictionaries({"text": TEXT}), min_size=1, max_size=4), "top_n": st.integers(-2, 8),
                          "return_documents": st.booleans()}),
    "/v1/completions": shaped({"model": MODELS, "prompt": TEXT, "max_tokens": st.integers(-2, 100),
                               "grammar": TEXT, "echo": st.booleans(), "best_of": st.integers(0, 2), **SAMPLING}),
    "/v1/chat/completions": shaped({"model": MODELS, "messages": st.lists(
        st.fixed_dictionaries({"role": TEXT, "content": TEXT}, optional={"name": TEXT}), max_size=3),
        "max_completion_tokens": st.integers(-2, 100), "tools": st.lists(JSON, max_size=1),
        "tool_choice": st.sampled_from(["none", "auto"]), "response_format": JSON, **SAMPLING}),
    "/v2/rerank": shaped({"model": MODELS, "query": TEXT, "documents": TEXTS, "top_n": st.integers(-2, 8),
                          "max_tokens_per_doc": st.integers(-1, 9), "truncate": st.booleans(),
                          "priority": st.integers(-1, 2), "return_documents": st.booleans()}),
    "/rerank": shaped({"model": MODELS, "query": TEXT, "texts": TEXTS, "raw_scores": st.booleans(),
                       "return_text": st.booleans(), "truncate": st.booleans(),
                       "truncation_direction": st.sampled_from(["right", "Right", "left", "Left"])}),
    "/tokenize": shaped({"model": MODELS, "prompt": TEXT, "messages": st.lists(
        st.fixed_dictionaries({"role": TEXT, "content": TEXT}), max_size=2), "add_special_tokens": st.booleans(),
                         "add_generation_prompt": st.booleans()}),
    "/detokenize": shaped({"model": MODELS, "tokens": IDS}),
    # TEI's and TGI's bodies; `/` takes each of them (TGI's is /generate's; the fuzzed daemon serves no generate
    # model, so TGI's bodies are checked, then refused)
    "/embed": shaped({"model": MODELS, "inputs": TEXT | TEXTS | IDS | st.lists(IDS, max_size=4),
                      "normalize": st.booleans(), "truncate": st.booleans(), "dimensions": st.none() | st.integers(),
                      "truncation_direction": st.sampled_from(["right", "Right", "left"]), "prompt_name": TEXT}),
    "/": shaped({"inputs": TEXT | TEXTS | shaped({"source_sentence": TEXT, "sentences": TEXTS}),
                 "parameters": shaped({"max_new_tokens": st.integers(-2, 100), "do_sample": st.booleans(),
                                       "return_full_text": st.booleans(), "details": st.booleans(),
                                       "repetition_penalty": NUMBER, "truncate": st.booleans(), "prompt_name": TEXT,
                                       **SAMPLING}),
                 "query": TEXT, "texts": TEXTS, "stream": st.booleans()}),
    # admin routes on a lane that does not exist: bodies are parsed, nothing is reloaded or unloaded
    "/v1/lanes/nolane/reload": shaped({"wait": st.booleans(), "stream": st.booleans()}),
    "/v1/lanes/nolane/drain": shaped({"wait": st.booleans(), "timeout_s": st.floats()}),
    "/v1/lanes/nolane/resume": shaped({}),
    "/v1/lanes/nolane/load": shaped({"model": MODELS, "path": TEXT, "stream": st.booleans()}),
    "/v1/lanes/nolane/unload": shaped({"model": MODELS}),
}


QUERY = st.lists(st.tuples(st.sampled_from(["model", "verbose", "", "model[]"]) | TEXT,
                            st.sampled_from([MODEL, "nope", ""]) | TEXT), max_size=3)


@pytest.mark.parametrize("route", [*BODIES, "GET /v1/lanes/{lane}", "GET /readyz"])
async def test_fuzz_route(tmp_path: Path, route: str) -> None:
    statuses: Counter[int] = Counter()
    async with trio.open_nursery() as nursery:
        client, daemon = await client_for(nursery, daemon_config(tmp_path, fake_command(), timeout_s=5.0,
                                                              http={"max_body_bytes": 1 << 20}))
        await client.aclose()
        sup = daemon.sup
        app = daemon.api.listener(admin=True)

        def case(method: str, path: str, body: bytes, query: bytes = b"") -> None:
            statuses[trio.from_thread.run(asgi_status, app, method, path, body, query)] += 1

        fuzz_settings = settings(max_examples=max(1, EXAMPLES // PER_EXAMPLE), deadline=None, database=None,
                                 suppress_health_check=list(HealthCheck))
        if route == "GET /readyz":  # query strings, encoded or raw bytes
            @fuzz_settings
            @given(st.lists(QUERY.map(lambda q: urllib.parse.urlencode(q, errors="surrogatepass").encode())
                            | st.binary(max_size=40), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
            def run(queries: list[bytes]) -> None:
                for query in queries:
                    case("GET", "/readyz", b"", query)
        elif route.startswith("GET "):
            @fuzz_settings
            @given(st.lists(TEXT, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
            def run(lanes: list[str]) -> None:
                for lane in lanes:
                    case("GET", f"/v1/lanes/{lane}", b"")
        else:
            @fuzz_settings
            @given(st.lists(VALID.get(route, st.nothing()) | BODIES[route] | RAW, min_size=PER_EXAMPLE,
                            max_size=PER_EXAMPLE))
            def run(bodies: list[Any]) -> None:
                for body in bodies:
                    case("POST", route, encode(body))

        await trio.to_thread.run_sync(run)
        strikes = [(s["strikes"], s["generation"]) for s in sup.status()]  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    print(route, dict(statuses))
    assert statuses[500] == 0, dict(statuses)
    assert sum(statuses.values()) >= EXAMPLES * 0.9  # hypothesis ran (nearly) every case
    assert strikes == [(0, 1)]
    if route in VALID:
        assert statuses[200] > EXAMPLES // 20, dict(statuses)  # the cases reached the worker too
