"""A GGUF's chat template (tokenizer.chat_template), rendered as transformers' apply_chat_template renders it.

Templates are Jinja code that came with a model file, so they run in jinja2's ImmutableSandboxedEnvironment (no
attribute access to Python internals, no mutation of the values passed in), with transformers' settings and
helpers: trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception(message)`,
`strftime_now(format)`, a `tojson` that leaves non-ASCII text and HTML characters as they are, and the
`{% generation %}` block (rendered as its body). A template's variables are the messages, add_generation_prompt,
the special tokens the GGUF names (bos_token, eos_token, unk_token, pad_token) and tools and documents, None
(docs/models.md, "Chat templates").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ._errors import InvalidRequest


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it; the text is
    the body's."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, specials: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template: {exc}") from exc
        self.source, self.specials = source, dict(specials)

    def __reduce__(self) -> tuple[Any, ...]:
        # a compiled template does not pickle (the JIT cache stores the worker's detokenizer): compile it again
        return ChatTemplate, (self.source, self.specials)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's prompt text; `tools`: OpenAI's tool definitions, for a template that
        describes them to the model (transformers passes them so too). InvalidRequest when the template refuses it
        (its raise_exception: roles that do not alternate, say) or fails on it."""
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.specials)
        except (jinja2.TemplateError, TypeError) as exc:
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from exc
