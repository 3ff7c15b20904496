"""Structured output: OpenAI's `response_format`, `tools` with `tool_choice`, and a raw `grammar`, each turned into
the one Lark grammar (llguidance's dialect) that GENERATE's `grammar` carries to the worker, and checked here
before any token is generated (docs/http-api.md, 'Structured output').

The daemon needs no tokenizer for this: llguidance checks a grammar (a JSON Schema it cannot compile, a Lark or
GBNF syntax error, an unknown rule) on its own, and the worker compiles it against its model's tokenizer
(models/constraint.py). A check is cached per distinct grammar, so a schema sent again costs a dictionary lookup.

Tool calls have one documented, deterministic format: the model writes the call as the JSON object
`{"name": <a tool's name>, "arguments": <that tool's parameters>}`; with `tool_choice: "auto"` it writes either
free text or `TOOL_CALL_TAG` followed by that object. `tool_call()` reads an answer back into OpenAI's
`tool_calls`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import llguidance

from ._errors import GrammarRefused, InvalidRequest, UnsupportedField

TOOL_CALL_TAG = "<tool_call>"  # tool_choice "auto": what begins a tool call instead of free text
MAX_GRAMMAR_CHARS = 64 * 1024  # a grammar (a schema as Lark): larger is refused unchecked (the check runs on the loop)
TOOL_CHOICES = ("none", "auto", "required")
_CHECKED = 1024  # distinct grammars whose check is kept


COMPACT = {"whitespace_flexible": False}  # llguidance's JSON layout: `,` and `:` between items, no whitespace


def _compact(schema: Any) -> Any:
    """`schema` with llguidance's compact JSON layout (unless the schema sets its own `x-guidance`): whitespace is
    no place for a model to wander off until max_tokens."""
    if schema is True:
        schema = {}
    return {"x-guidance": COMPACT, **schema} if isinstance(schema, dict) else schema


def _lark_json(schema: Any) -> str:
    """A grammar whose sentences are the JSON values `schema` validates, laid out compactly."""
    return f"start: %json {json.dumps(_compact(schema), separators=(',', ':'))}\n"


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{what}' must be an object")
    return value


def _keys(value: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    for key in value:
        if key not in allowed:
            raise UnsupportedField(f"{what}.{key}", "is not a field this daemon implements")


def response_format_grammar(rf: Any) -> str | None:
    """`response_format`: {"type": "text"} (no grammar), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?, "description"?}} (JSON the schema
    validates; no schema: any JSON value)."""
    rf = _object(rf, "response_format")
    kind = rf.get("type")
    if kind == "text":
        _keys(rf, ("type",), "response_format")
        return None
    if kind == "json_object":
        _keys(rf, ("type",), "response_format")
        return _lark_json({"type": "object"})
    if kind != "json_schema":
        raise InvalidRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    _keys(rf, ("type", "json_schema"), "response_format")
    spec = _object(rf.get("json_schema"), "response_format.json_schema")
    _keys(spec, ("name", "schema", "strict", "description"), "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("'response_format.json_schema.name' must be a non-empty string")
    if spec.get("strict") not in (None, True, False):
        raise InvalidRequest("'response_format.json_schema.strict' must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise InvalidRequest("'response_format.json_schema.schema' must be a JSON Schema (an object)")
    return _lark_json(schema)


def _tools(tools: Any) -> dict[str, Any]:
    """Each function's name -> its parameters' schema (OpenAI's default: an object with no declared properties)."""
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        tool = _object(tool, f"tools[{i}]")
        _keys(tool, ("type", "function"), f"tools[{i}]")
        if tool.get("type") != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function', got {tool.get('type')!r}")
        fn = _object(tool.get("function"), f"tools[{i}].function")
        _keys(fn, ("name", "description", "parameters", "strict"), f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"'tools[{i}].function.name' must be a non-empty string")
        if name in out:
            raise InvalidRequest(f"tools[{i}]: a second function named {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"'tools[{i}].function.parameters' must be a JSON Schema (an object)")
        out[name] = params
    return out


def _tool_choice(choice: Any, names: Mapping[str, Any]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("named", the name of the one function to call)."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, "
                                 f"got {choice!r}")
        if choice != "none" and not names:
            raise InvalidRequest(f"tool_choice {choice!r} needs 'tools'")
        return choice, None
    choice = _object(choice, "tool_choice")
    _keys(choice, ("type", "function"), "tool_choice")
    fn = _object(choice.get("function"), "tool_choice.function")
    _keys(fn, ("name",), "tool_choice.function")
    if choice.get("type") != "function" or fn.get("name") not in names:
        raise InvalidRequest(f"tool_choice names no function of 'tools': {fn.get('name')!r}")
    return "named", str(fn["name"])


def call_schema(names: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one call of any of these functions: {"name": ..., "arguments": ...}."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
              "required": ["name", "arguments"], "additionalProperties": False} for n, p in names.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tools_grammar(tools: Any, tool_choice: Any) -> tuple[str | None, str]:
    """(the grammar, the tool mode: "none", "auto" or "call") of `tools` and `tool_choice` (OpenAI's default:
    "auto" with tools, "none" without)."""
    names = _tools(tools) if tools is not None else {}
    choice, name = _tool_choice(("auto" if names else "none") if tool_choice is None else tool_choice, names)
    if choice == "none":
        return None, "none"
    if choice == "auto":
        schema = json.dumps(_compact(call_schema(names)), separators=(",", ":"))
        return f"start: TEXT | {json.dumps(TOOL_CALL_TAG)} %json {schema}\nTEXT: /(.|\\n)*/\n", "auto"
    if name is not None:
        names = {name: names[name]}
    return _lark_json(call_schema(names)), "call"


def raw_grammar(text: str) -> str:
    """The `grammar` field's text (Lark, or GBNF as llama.cpp's server takes it) as Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # its parser's own errors: the grammar's, not ours
        raise GrammarRefused("grammar", f"is not a grammar llguidance reads: {exc}") from None


_problems: OrderedDict[bytes, str] = OrderedDict()  # a grammar's digest -> what llguidance refused ("" if nothing)


def _problem(lark: str) -> str:
    """llguidance's verdict on `lark`, kept per digest (a grammar may be large: its text is not kept)."""
    key = hashlib.sha256(lark.encode("utf-8", "surrogatepass")).digest()
    found = _problems.pop(key, None)  # taken out and put back last: the most recently used stay
    if found is None:
        found = str(llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark)))
    _problems[key] = found
    while len(_problems) > _CHECKED:
        _problems.popitem(last=False)
    return found


def check_grammar(lark: str, field: str) -> str:
    """`lark` if llguidance compiles it, else GrammarRefused naming `field` and what was refused."""
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise GrammarRefused(field, f"is {len(lark)} characters as a grammar; at most {MAX_GRAMMAR_CHARS}")
    if problem := _problem(lark):
        raise GrammarRefused(field, f"was refused by the grammar engine: {problem.strip()}")
    return lark


def tool_call(text: str, mode: str) -> list[dict[str, Any]] | None:
    """OpenAI's `tool_calls` of an answer written under tool mode `mode` ("call", "auto"), or None when it is
    free text (or a call cut short by max_tokens, which is then the answer's content)."""
    if mode == "auto":
        if not text.startswith(TOOL_CALL_TAG):
            return None
        text = text[len(TOOL_CALL_TAG):]
    elif mode != "call":
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


__all__ = ["MAX_GRAMMAR_CHARS", "TOOL_CALL_TAG", "TOOL_CHOICES", "call_schema", "check_grammar", "raw_grammar",
           "response_format_grammar", "tool_call", "tools_grammar"]
