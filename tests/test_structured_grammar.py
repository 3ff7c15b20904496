"""Structured output without a model: what `response_format`, `tools` and `grammar` become, the GRAMMAR extension's
negotiation, a worker-side Constraint over a small vocabulary, and tool calls read back."""

from __future__ import annotations

import json
from typing import ClassVar

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from trio_gpuworker import _structured as structured
from trio_gpuworker._errors import GrammarRefused, InvalidRequest, UnsupportedField
from trio_gpuworker._proto import EXT_GRAMMAR, required_extensions
from trio_gpuworker.engine import Engine
from trio_gpuworker.models.constraint import Grammars

WORDS = ["a", "b", "y", "e", "s", "n", "o", "ye", "no", "yes", "{", "}", '"', ":", ",", "<eos>"]
EOS = WORDS.index("<eos>")


def test_a_grammar_needs_the_extension() -> None:
    assert required_extensions("GENERATE", {"grammar": 'root ::= "a"'}) == {EXT_GRAMMAR}
    assert required_extensions("GENERATE", {"grammar": None}) == frozenset()

    class Constrained(Engine):
        grammars: ClassVar[bool] = True

        def generate(self, request, ctx):  # type: ignore[no-untyped-def]
            return "x"

    assert EXT_GRAMMAR in Constrained().extensions()
    assert EXT_GRAMMAR not in type("Plain", (Constrained,), {"grammars": False})().extensions()


def test_each_field_becomes_one_checked_grammar() -> None:
    assert structured.response_format_grammar({"type": "text"}) is None
    for rf in ({"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}}):
        lark = structured.response_format_grammar(rf)
        assert lark is not None and lark.startswith("start: %json ")
        assert structured.check_grammar(lark, "response_format") == lark
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert structured.tools_grammar(tools, "none") == (None, "none")
    assert structured.tools_grammar(None, None) == (None, "none")
    assert structured.tools_grammar(tools, None)[1] == "auto"
    assert structured.tools_grammar(tools, "required")[1] == "call"
    assert structured.raw_grammar('root ::= "a" | "b"').strip().startswith("%llguidance")
    with pytest.raises(GrammarRefused) as info:
        structured.check_grammar(structured.raw_grammar("root ::= missing"), "grammar")
    assert info.value.param == "grammar" and info.value.code == "grammar_invalid"
    with pytest.raises(UnsupportedField):
        structured.response_format_grammar({"type": "json_schema", "json_schema": {"name": "n", "x": 1}})
    with pytest.raises(InvalidRequest):
        structured.tools_grammar(tools, {"type": "function", "function": {"name": "g"}})


def test_tool_calls_read_back() -> None:
    (call,) = structured.tool_call('{"name":"f","arguments":{"x":1}}', "call") or []
    assert call["function"] == {"name": "f", "arguments": json.dumps({"x": 1})} and call["type"] == "function"
    assert structured.tool_call(structured.TOOL_CALL_TAG + '{"name":"f","arguments":{}}', "auto") is not None
    assert structured.tool_call("free text", "auto") is None
    assert structured.tool_call('{"name":"f","argu', "call") is None  # cut by max_tokens: the text stays content
    assert structured.tool_call('{"name":"f","arguments":{}}', "none") is None


def test_a_constraint_masks_and_ends_with_its_grammar() -> None:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tok.decoder = decoders.ByteLevel()  # printable ASCII is its own byte-level text
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    grammars = Grammars(tok, len(WORDS), {EOS})
    c = grammars.constraint('root ::= "yes" | "no"')
    allowed = {WORDS[i] for i in np.flatnonzero(c.allowed())}
    assert allowed == {"y", "ye", "yes", "n", "no"}
    logits = np.arange(len(WORDS), dtype=np.float32)
    masked = c.masked(logits)
    assert np.isneginf(masked[WORDS.index("a")]) and masked[WORDS.index("yes")] == WORDS.index("yes")
    assert not c.allows(WORDS.index("a")) and c.allows(WORDS.index("ye"))
    assert {WORDS[i] for i in np.flatnonzero(c.allowed())} == {"s"}
    c.take(WORDS.index("s"))
    assert c.done or {WORDS[i] for i in np.flatnonzero(c.allowed())} == {"<eos>"}
    # compiled once: the next request's constraint starts afresh from the kept matcher
    again = grammars.constraint('root ::= "yes" | "no"')
    assert {WORDS[i] for i in np.flatnonzero(again.allowed())} == allowed
    with pytest.raises(ValueError, match="grammar"):
        grammars.constraint("root ::= undefined")
