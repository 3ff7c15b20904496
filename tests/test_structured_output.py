"""Structured output against a real daemon and its real tinygrad worker serving a tiny random-weight model:
`response_format`, `tools` / `tool_choice` and a raw `grammar` constrain every token, greedy and sampled, and what
the engine cannot compile is a 400 before any token (docs/http-api.md, 'Structured output').

A random model left alone writes anything; under a constraint its every answer must parse and validate, which
`jsonschema` (an independent validator) and Python's `re` check. Constrained greedy decoding is also replayed by
the independent numpy decoder (tests/support/reference_llama.py) with the grammar's allowed set computed by brute force
over a finite language, token for token."""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.daemon_process import CONTEXT, TINY_LM, TOOLS_TEMPLATE, tiny_daemon
from tests.support.reference_llama import NumpyLlama
from trio_gpuworker import _structured as structured
from trio_gpuworker._structured import TOOL_CALL_TAG
from trio_gpuworker.llm_tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 300  # bounded schemas below need far fewer: a "length" finish is a failure here
SAMPLED = {"temperature": 1.0, "seed": 11}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "admin": {"type": "boolean"}},
          "required": ["name", "age", "admin"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path]]:
    folder = tmp_path_factory.mktemp("structured")
    with tiny_daemon(folder) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client, folder / "tiny.gguf"


@pytest.fixture(scope="module")
def http(daemon: tuple[httpx.Client, Path]) -> httpx.Client:
    return daemon[0]


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": TINY_LM, "messages": ASK, "max_tokens": MAX_TOKENS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http: httpx.Client, path: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    start = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"}
    r = http.post(path, json={"model": TINY_LM, "max_tokens": 8, **start, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def content(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # ended by the grammar, not cut by max_tokens
    return choice["message"]["content"]


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_and_json_schema(http: httpx.Client, sampling: dict[str, Any]) -> None:
    assert isinstance(json.loads(content(chat(http, response_format={"type": "json_object"}, **sampling))), dict)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    jsonschema.validate(json.loads(content(chat(http, response_format=rf, **sampling))), PERSON)


def test_the_unconstrained_model_does_not_write_json_by_itself(http: httpx.Client) -> None:
    """The constraint is what makes the answers above JSON: the same request without it writes none."""
    text = chat(http, max_tokens=24)["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(text)
    assert chat(http, max_tokens=24, response_format={"type": "text"})["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_required_and_named_tool_calls(http: httpx.Client, sampling: dict[str, Any]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice, names in (("required", set(schemas)), ({"type": "function", "function": {"name": "get_time"}},
                                                       {"get_time"})):
        out = chat(http, tools=[WEATHER, TIME], tool_choice=choice, **sampling)["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
        (call,) = out["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_tool_choice_auto_and_none(http: httpx.Client) -> None:
    """"auto": free text or a tool call, whichever the model writes; "none": plain text, as without tools."""
    for seed in range(4):
        out = chat(http, tools=[WEATHER], max_tokens=40, temperature=1.0, seed=seed)["choices"][0]
        if out["finish_reason"] == "tool_calls":
            (call,) = out["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        else:
            assert not out["message"]["content"].startswith(TOOL_CALL_TAG) and "tool_calls" not in out["message"]
    plain = chat(http, max_tokens=12)["choices"][0]["message"]["content"]
    none = chat(http, max_tokens=12, tools=[WEATHER], tool_choice="none")["choices"][0]
    assert none["message"]["content"] == plain and none["finish_reason"] == "length"


def test_the_tools_are_described_in_the_prompt(daemon: tuple[httpx.Client, Path]) -> None:
    """A template that renders `tools` gets the tools the model may call (none with tool_choice "none"): the prompt's
    token count is that of the template rendered by plain jinja2 with them."""
    http, path = daemon
    tok = ChatTokenizer.from_gguf(path)
    template = jinja2.Environment()
    template.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    render = template.from_string(TOOLS_TEMPLATE)

    def n_prompt(tools: list[dict[str, Any]] | None) -> int:
        return len(tok.encode(render.render(messages=ASK, tools=tools, add_generation_prompt=True)))

    for choice, described in (("required", [WEATHER, TIME]), ("auto", [WEATHER, TIME]), ("none", None)):
        out = chat(http, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=4)
        assert out["usage"]["prompt_tokens"] == n_prompt(described), choice
    assert n_prompt([WEATHER, TIME]) > n_prompt(None) + 100


def test_tool_call_streamed_as_openai_streams_it(http: httpx.Client) -> None:
    body = {"model": TINY_LM, "messages": ASK, "max_tokens": MAX_TOKENS, "tools": [WEATHER],
            "tool_choice": "required", "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    whole = chat(http, tools=[WEATHER], tool_choice="required")["choices"][0]["message"]["tool_calls"][0]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == whole["function"]["arguments"]  # greedy: the same
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    assert events[-1]["usage"]["completion_tokens"] > 0


def test_raw_grammar_gbnf_and_lark(http: httpx.Client) -> None:
    gbnf = r'root ::= "id-" [0-9] [0-9] [0-9] ("-" ("a" | "b"))?'
    lark = 'start: "x" NUM "y"\nNUM: /[1-9][0-9]?/'
    for grammar, pattern in ((gbnf, r"id-[0-9]{3}(-[ab])?"), (lark, r"x[1-9][0-9]?y")):
        for sampling in ({}, SAMPLED):
            assert re.fullmatch(pattern, content(chat(http, grammar=grammar, **sampling)))
            r = http.post("/v1/completions", json={"model": TINY_LM, "prompt": "Say", "max_tokens": 16,
                                                   "grammar": grammar, **sampling})
            assert r.status_code == 200 and re.fullmatch(pattern, r.json()["choices"][0]["text"]), r.text


def test_what_the_engine_or_the_api_refuses(http: httpx.Client) -> None:
    for rf, param, what in (
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format",
         "nonsense"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}},
         "response_format", "look-around"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
         "response_format", "missing"),
    ):
        err = refused(http, response_format=rf)
        assert (err["code"], err["param"]) == ("grammar_invalid", param) and what in err["message"], err
    huge = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i:06d}" for i in range(8000)]}}}
    err = refused(http, response_format=huge)
    assert (err["code"], err["param"]) == ("grammar_invalid", "response_format") and "at most" in err["message"]
    err = refused(http, grammar="root ::= undefined_rule")
    assert (err["code"], err["param"]) == ("grammar_invalid", "grammar") and "undefined_rule" in err["message"]
    assert refused(http, "/v1/completions", grammar="start: (")["code"] == "grammar_invalid"
    for body, what in (
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "give one of them"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": [WEATHER, WEATHER]}, "a second function"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ):
        err = refused(http, **body)
        assert err["code"] == "invalid_request" and what in err["message"], (body, err)
    err = refused(http, response_format={"type": "json_object", "extra": 1})
    assert (err["code"], err["param"]) == ("unsupported_field", "response_format.extra")


def test_constrained_greedy_matches_the_numpy_reference(daemon: tuple[httpx.Client, Path]) -> None:
    """Greedy under a grammar of a finite language: at each step the reference decoder's logits, masked to the
    tokens that keep the text a prefix of a sentence (end-of-generation once it is one), give the same argmax
    the worker picked. The allowed set here is brute force over the token strings, not llguidance."""
    http, path = daemon
    words = ["alpha", "alpine", "al", "beta", "b", "gamma ray", "[]{}"]
    grammar = "root ::= " + " | ".join(json.dumps(w) for w in words)
    prompt = "Pick one word:"
    r = http.post("/v1/completions", json={"model": TINY_LM, "prompt": prompt, "max_tokens": 16, "grammar": grammar})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["text"]
    tok = ChatTokenizer.from_gguf(path)
    vocab = [tok.decode([i]) for i in range(tok.tokenizer.get_vocab_size())]
    ref = NumpyLlama(path)
    ids, text = tok.encode(prompt, add_special=True), ""
    for _ in range(16):
        ref.generate(ids, 1)
        logits = ref.logits[-1]
        allowed = np.array([bool(v) and any(w.startswith(text + v) for w in words) for v in vocab])
        for e in tok.eos_ids:
            allowed[e] = text in words
        nxt = int(np.argmax(np.where(allowed, logits, -np.inf)))
        if nxt in tok.eos_ids:
            break
        ids, text = [*ids, nxt], text + vocab[nxt]
        if not any(w.startswith(text) and w != text for w in words):
            break  # nothing may follow: the worker ends here without asking the model
    assert got == text and got in words


def test_a_batch_masks_each_sequence_as_it_is_masked_alone(daemon: tuple[httpx.Client, Path]) -> None:
    """Sequences decoded together (models/batched.py), each under its own grammar or none, greedy and seeded
    sampled, joining at different steps: each gets the ids and finish it gets from generate() alone."""
    from trio_gpuworker.models.batched import Batch
    from trio_gpuworker.models.constraint import Grammars
    from trio_gpuworker.models.llama_fused import FusedLlamaLM
    from trio_gpuworker.models.sampling import GREEDY, SamplingParams

    path = daemon[1]
    lm = FusedLlamaLM.load(path, max_context=CONTEXT)
    tok = ChatTokenizer.from_gguf(path)
    grammars = Grammars(tok.tokenizer, lm.vocab_size, lm.eos_ids)
    person = structured.response_format_grammar({"type": "json_schema",
                                                 "json_schema": {"name": "p", "schema": PERSON}})
    runs = [("Who is it?", GREEDY, person), ("Name one", SamplingParams(temperature=1.0, seed=3), person),
            ("x", GREEDY, None), ("Yes or no?", SamplingParams(temperature=0.7, top_p=0.9, seed=8),
                                  'root ::= "yes" | "no" | "maybe so"')]
    prompts = [np.array(tok.encode(text), np.int32) for text, _, _ in runs]
    alone = [lm.generate(p, 120, sampling=s, constraint=grammars.constraint(g) if g else None)
             for p, (_, s, g) in zip(prompts, runs, strict=True)]
    batch, seqs = Batch(lm), []
    for i, (p, (_, s, g)) in enumerate(zip(prompts, runs, strict=True)):
        seqs.append(batch.join(p, 120, sampling=s, constraint=grammars.constraint(g) if g else None))
        for _ in range(i * 3):  # the next joins a few steps later
            batch.step()
    while batch.live:
        batch.step()
    assert [(s.ids, s.finish) for s in seqs] == alone
    for ids, _ in alone[:2]:
        jsonschema.validate(json.loads(tok.decode(ids, skip_special=True)), PERSON)
    assert tok.decode(alone[3][0]) in ("yes", "no", "maybe so")


def test_concurrent_constrained_requests(http: httpx.Client) -> None:
    """Requests at once (the daemon decodes them together): each answer validates, the greedy one as alone."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    lone = content(chat(http, response_format=rf))
    bodies = [{"response_format": rf}, {"response_format": rf, **SAMPLED}, {"grammar": 'root ::= "yes" | "no"'},
              {"tools": [WEATHER], "tool_choice": "required", "temperature": 0.5, "seed": 2}]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: chat(http, **b), bodies))
    assert content(answers[0]) == lone
    jsonschema.validate(json.loads(content(answers[1])), PERSON)
    assert content(answers[2]) in ("yes", "no")
    (call,) = answers[3]["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


# --- property: generated schemas ----------------------------------------------------------------------------------

LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).flatmap(lambda lo: st.integers(lo, lo + 500).map(
        lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
)


def _object(props: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.sets(st.sampled_from(sorted(props)), max_size=len(props)).map(
        lambda req: {"type": "object", "properties": props, "required": sorted(req), "additionalProperties": False})


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        st.dictionaries(st.text("abkmnpqz", min_size=1, max_size=4), inner, min_size=1, max_size=3).flatmap(_object),
        st.lists(inner, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts}),
    ),
    max_leaves=6,
)
PROPERTY = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@PROPERTY
@given(schema=SCHEMAS, sampled=st.booleans())
def test_every_constrained_answer_validates(http: httpx.Client, schema: dict[str, Any], sampled: bool) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "generated", "schema": schema}}
    answer = chat(http, response_format=rf, **(SAMPLED if sampled else {}))
    jsonschema.validate(json.loads(content(answer)), schema)


BAD = st.one_of(
    st.text("abcdefgh", min_size=1, max_size=8).filter(
        lambda t: t not in ("array", "boolean", "integer", "null", "number", "object", "string")).map(
        lambda t: {"type": t}),
    st.sampled_from(["(?=a)", "(?<!b)c", "a\\Z(?=x)"]).map(lambda p: {"type": "string", "pattern": p}),
    st.text("abcdef", min_size=1, max_size=6).map(lambda name: {"$ref": f"#/$defs/{name}"}),
)


@PROPERTY
@given(schema=BAD, where=st.sampled_from(["response_format", "tools"]))
def test_a_schema_the_engine_refuses_is_a_400(http: httpx.Client, schema: dict[str, Any], where: str) -> None:
    if where == "tools":
        body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required"}
    else:
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}}
    err = refused(http, **body)
    assert (err["code"], err["param"]) == ("grammar_invalid", where), err
