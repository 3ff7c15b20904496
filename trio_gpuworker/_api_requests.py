"""One typed request per API call, validated once: `EmbeddingsRequest`, `RerankRequest`, `CompletionRequest`.

A request is a frozen dataclass built from Python arguments (its constructor) or from a JSON body (`from_json`,
which only unwraps the body's shapes and then calls the constructor). Either way the constructor is the one
validation path: the model's lookup (ModelNotFound) and kind check (`_kinds.check_serves`), each field's type,
bounds and default, and every refusal (InvalidRequest, RequestTooLarge). `to_wire()` is the protocol message that
carries it, once the Supervisor has tokenized it. Pure: no I/O; the Supervisor admits, tokenizes and sends.

A field says which JSON bodies take it and under which names (`arg(body=...)`); a class's `NEUTRAL` lists the
fields a body accepts only at the value that leaves the answer unchanged. The HTTP routes' field tables are
derived from these (`body_fields()`), so a new field is one `arg` here and a row in docs/http-api.md, 'Fields'.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from . import _api_checks as ck
from . import _structured as structured
from ._config import ModelConfig, SupervisorConfig
from ._errors import InvalidRequest, RequestTooLarge, UnsupportedField
from ._kinds import EMBEDDING, GENERATE, RERANK, check_serves
from ._proto import MAX_TOP_LOGPROBS, EmbedBatch, Generate, Rerank

_BODY = "body"
A = TypeVar("A", bound="ApiRequest")
OnDelta = Callable[[dict[str, Any]], None]  # a completion's text as it is generated: {text, n_gen, logprobs?}
CHAT_TEMPLATE_BYTES = 64  # per message: what a chat template adds around its content, at most
ENCODING_FORMATS = ("float", "base64")
STREAM_OPTIONS = ("include_usage",)
MESSAGE: ck.Spec = {"role": None, "content": None, "name": None}  # a chat message's fields, and a content part's
CONTENT_PART: ck.Spec = {"type": None, "text": None}
PARAMETERS = "parameters"  # where TGI's body and TEI's similarity body nest their options


def _right_only(v: Any) -> str | None:
    """TEI's `truncation_direction`: inputs are cut on the right only."""
    return None if v in ("right", "Right") else f"= {ck.short(v)} is not supported: inputs are truncated on the right"


def arg(default: Any = dataclasses.MISSING, *, body: bool | Mapping[str, tuple[str, ...]] = True) -> Any:
    """A request field. `body`: the names a JSON body gives it under, per body shape (True: its own name in every
    shape of the class; False: not a body field). A field with several names takes its value from any of them
    (an alias), unless its class's `from_json` reads them itself."""
    return dataclasses.field(default=default, metadata={_BODY: body})


def derived() -> Any:
    """A field the checks set (the model's configuration, a resolved default): not an argument."""
    return dataclasses.field(init=False, repr=False, compare=False)


def api_request(cls: type[A]) -> type[A]:
    """Make `cls` a frozen, keyword-only dataclass: a request class (as `_proto._wire.message` makes a message)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def configured_model(models: SupervisorConfig, model: Any) -> ModelConfig:
    """The model's configuration: the daemon's one model lookup (ModelNotFound if there is none)."""
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    return models.model(model)


def serving_model(models: SupervisorConfig, model: Any, what: str) -> ModelConfig:
    """The model's configuration, if its kind serves the API request `what` (the one kind check)."""
    mc = configured_model(models, model)
    check_serves(mc.id, mc.kind, what)
    return mc


def json_list(value: Any, key: str, max_inputs: int, *, ids: bool = False) -> list[Any]:
    """A body's list of inputs: non-empty, at most http.max_inputs (the HTTP API's own rules; what each item must
    be is the request's check, as for the Python API)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"'{key}' must be a string or a non-empty list of strings"
                             + (", a list of token ids or a non-empty list of them" if ids else ""))
    if len(value) > max_inputs:
        raise InvalidRequest(f"'{key}' has {len(value)} items; at most {max_inputs} per request (http.max_inputs)")
    return value


@api_request
class ApiRequest(abc.ABC):
    """What every request has: its model, looked up and kind-checked when it is built."""

    WHAT: ClassVar[str]  # the API request, as _kinds.API_REQUESTS names it: the kind check
    NEUTRAL: ClassVar[Mapping[str, ck.Spec]] = {}  # per body shape: fields accepted at one value only

    models: dataclasses.InitVar[SupervisorConfig]
    model: str = arg()
    mc: ModelConfig = derived()

    def __post_init__(self, models: SupervisorConfig) -> None:
        self._set(mc=serving_model(models, self.model, self.WHAT))
        self._check(self.mc)

    @abc.abstractmethod
    def _check(self, mc: ModelConfig) -> None:
        """Each field checked, and its default resolved, in the order the errors are reported."""

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def body_fields(cls, shape: str = "") -> dict[str, ck.Neutral | None]:
        """The fields a `shape` body takes: each field's names (None: the request reads it), then its NEUTRAL."""
        out: dict[str, ck.Neutral | None] = {}
        for _, names in _body_names(cls, shape):
            out.update(dict.fromkeys(names))
        return {**out, **cls.NEUTRAL.get(shape, {})}

    @staticmethod
    def json_model(body: Mapping[str, Any], models: SupervisorConfig) -> str:
        """The body's model, if one is configured: ModelNotFound (404) comes before any other check of the body."""
        return configured_model(models, body.get("model")).id

    @classmethod
    def _json_args(cls, body: Mapping[str, Any], shape: str, *skip: str) -> dict[str, Any]:
        """Each field's value in the body, under any of its names (a JSON null is a field left out: its default;
        two names given different values are refused), but for the model and the fields in `skip`, which
        `from_json` reads itself."""
        out: dict[str, Any] = {}
        for name, names in _body_names(cls, shape):
            given = {n: body[n] for n in names if body.get(n) is not None}
            if not given or name == "model" or name in skip:
                continue
            first, *others = given.values()
            if any(v != first for v in others):
                raise InvalidRequest(f"{' and '.join(given)} differ: give one of them")
            out[name] = first
        return out

    @classmethod
    def nested_fields(cls, shape: str, top: tuple[str, ...]) -> tuple[dict[str, ck.Neutral | None], ck.Spec]:
        """A body that nests its options under `parameters` (TGI's, TEI's similarity): the fields of its top level
        (`top` and `parameters`) and those of its `parameters` (the shape's others but the model: the route picks
        the one model)."""
        fields = cls.body_fields(shape)
        return ({k: fields[k] for k in top} | {PARAMETERS: None},
                {k: v for k, v in fields.items() if k not in top and k != "model"})

    @classmethod
    def _unnested(cls, body: Mapping[str, Any], shape: str, top: tuple[str, ...]) -> dict[str, Any]:
        """Such a body's fields in one mapping: its `parameters` (each checked, named `parameters.<key>`) and its
        top-level fields."""
        params = body.get(PARAMETERS)
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidRequest(f"'{PARAMETERS}' must be an object")
        ck.check_fields(params, cls.nested_fields(shape, top)[1], f"{PARAMETERS}.")
        return {**params, **{k: body[k] for k in top if k in body}}


@functools.cache
def _body_names(cls: type[ApiRequest], shape: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each field a `shape` body gives, and the names it gives it under (the first is its own; any other, an
    alias)."""
    out = []
    for f in dataclasses.fields(cls):
        body = f.metadata.get(_BODY, False)
        names = (f.name,) if body is True else () if body is False else body.get(shape, ())
        if names:
            out.append((f.name, names))
    return tuple(out)


@api_request
class EmbeddingsRequest(ApiRequest):
    """Embeddings of `input`: texts, or token-id lists embedded as given. Longer than the model's max_tokens: cut,
    or refused (RequestTooLarge) with `truncate` false. `dimensions`: one of the model's matryoshka_dims. Bodies:
    OpenAI's (shape ""), text-embeddings-inference's `/embed` ("tei") and its sentence similarity ("similarity":
    `inputs: {source_sentence, sentences}`, options under `parameters`)."""

    WHAT = "embeddings"
    NEUTRAL: ClassVar[Mapping[str, ck.Spec]] = {
        shape: {"truncation_direction": _right_only,
                "prompt_name": ck.never("the daemon's models declare no prompts")} for shape in ("tei", "similarity")}

    input: list[Any] = arg(body={"": ("input",), "tei": ("inputs",), "similarity": ("inputs",)})
    pooling: str | None = arg(None, body={"": ("pooling",)})  # None: the model's
    normalize: bool | None = arg(None, body={"": ("normalize",), "tei": ("normalize",)})  # None: the model's
    truncate: bool = arg(True)
    dimensions: int | None = arg(None, body={"": ("dimensions",), "tei": ("dimensions",)})
    encoding_format: str = arg("float", body={"": ("encoding_format",)})  # of the HTTP answer's vectors
    user: str | None = arg(None, body={"": ("user",)})  # an end-user id for the caller's records
    is_ids: bool = derived()

    def _check(self, mc: ModelConfig) -> None:
        is_ids, items = ck.check_inputs(self.input, "input")
        self._set(input=items, is_ids=is_ids, pooling=ck.check_pooling(self.pooling, mc),
                  normalize=ck.check_normalize(self.normalize, mc),
                  truncate=ck.check_flag(self.truncate, "truncate", True),
                  dimensions=ck.check_dimensions(self.dimensions, mc),
                  encoding_format=ck.check_choice(self.encoding_format, "encoding_format", ENCODING_FORMATS),
                  user=ck.check_text(self.user, "user"))

    @classmethod
    def from_json(cls, body: Mapping[str, Any], models: SupervisorConfig, *, max_inputs: int,
                  shape: str = "") -> EmbeddingsRequest:
        """OpenAI's body: `input` one string, one list of token ids, or a list of either; TEI's the same as
        `inputs`, which name no model (the one embedding model serves them) and normalize unless told not to (TEI's
        default). The similarity body embeds its source sentence first, then its sentences, unnormalized."""
        if shape == "similarity":
            body = cls._unnested(body, shape, ("inputs",))
            pair = body.get("inputs")
            if not isinstance(pair, dict) or set(pair) != {"source_sentence", "sentences"}:
                raise InvalidRequest("'inputs' must be {\"source_sentence\": string, \"sentences\": [string, ...]}")
            sentences = json_list(pair["sentences"], "inputs.sentences", max_inputs - 1)
            return cls(models=models, model=only_model(models, EMBEDDING), normalize=False,
                       input=[pair["source_sentence"], *sentences], **cls._json_args(body, shape, "input"))
        key = "inputs" if shape == "tei" else "input"
        model = only_model(models, EMBEDDING) if shape == "tei" and body.get("model") is None else \
            cls.json_model(body, models)
        inputs = body.get(key)
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(_is_id(x) for x in inputs)):
            inputs = [inputs]
        args = cls._json_args(body, shape, "input")
        if shape == "tei":
            args.setdefault("normalize", True)
        return cls(models=models, model=model, input=json_list(inputs, key, max_inputs, ids=True), **args)

    def to_wire(self, rows: list[np.ndarray]) -> EmbedBatch:
        """The EMBED_BATCH of these token-id rows of this request."""
        return embed_batch(self.model, self.pooling, self.normalize, rows)


def embed_batch(model: str, pooling: str | None, normalize: bool | None, rows: list[np.ndarray]) -> EmbedBatch:
    """EMBED_BATCH of token-id rows, one item each, their ids int32 LE back to back (rows of several callers'
    requests, when the batcher merged them)."""
    assert pooling is not None and normalize is not None, "resolved by the request's checks"
    return EmbedBatch(model_ref=model, pooling=pooling, normalize=normalize,
                      items=[{"id": i, "n_tokens": len(r)} for i, r in enumerate(rows)],
                      raw=(np.concatenate(rows) if rows else np.zeros(0)).astype("<i4").tobytes())


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@api_request
class RerankRequest(ApiRequest):
    """The relevance of each of `documents` to `query`: a cross-encoder's logit, or a cosine for an embedding
    model. Bodies: Cohere's, Jina's and Voyage's (shape ""), text-embeddings-inference's ("tei")."""

    WHAT = "rerank"
    NEUTRAL: ClassVar[Mapping[str, ck.Spec]] = {
        "": {"priority": ck.only(0, "requests are served in arrival order")},
        "tei": {"truncation_direction": _right_only},
    }

    query: str = arg()
    documents: list[str] = arg(body={"": ("documents",), "tei": ("texts",)})
    truncate: bool = arg(True, body={"": ("truncate", "truncation"), "tei": ("truncate",)})  # truncation: Voyage's
    max_tokens_per_doc: int | None = arg(None, body={"": ("max_tokens_per_doc",)})  # each document cut there
    top_n: int | None = arg(None, body={"": ("top_n", "top_k")})  # the answer's best n (None: all); top_k: Voyage's
    return_documents: bool = arg(False, body={"": ("return_documents",), "tei": ("return_text",)})
    raw_scores: bool = arg(False, body={"tei": ("raw_scores",)})  # TEI: no sigmoid on a cross-encoder's logit

    def _check(self, mc: ModelConfig) -> None:
        if not isinstance(self.query, str):
            raise InvalidRequest("query must be a string")
        self._set(documents=ck.check_texts(self.documents, "documents"),
                  truncate=ck.check_flag(self.truncate, "truncate", True),
                  max_tokens_per_doc=ck.check_count(self.max_tokens_per_doc, "max_tokens_per_doc"),
                  top_n=ck.check_count(self.top_n, "top_n"),
                  return_documents=ck.check_flag(self.return_documents, "return_documents", False),
                  raw_scores=ck.check_flag(self.raw_scores, "raw_scores", False))

    @classmethod
    def from_json(cls, body: Mapping[str, Any], models: SupervisorConfig, *, max_inputs: int,
                  shape: str = "", one_model: bool = False) -> RerankRequest:
        """Cohere's and Jina's documents may be `{"text": ...}`; TEI's body may name no model (`tei_model`), and so
        may Cohere's on a route that serves one model (`one_model`: /rerank, as vLLM and infinity serve it there).
        The HTTP API wants a non-empty query and list of documents."""
        tei = shape == "tei"
        model = tei_model(models) if (tei or one_model) and body.get("model") is None else \
            cls.json_model(body, models)
        docs = body.get("texts" if tei else "documents")
        if not tei and isinstance(docs, list) and docs and all(isinstance(d, dict) for d in docs):
            for i, d in enumerate(docs):  # [{"text": ...}] as Jina and Cohere's v1 send
                if set(d) != {"text"} or not isinstance(d["text"], str):
                    raise InvalidRequest(f"documents[{i}] must be a string or {{\"text\": string}}")
            docs = [d["text"] for d in docs]
        docs = json_list(docs, "texts" if tei else "documents", max_inputs)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise InvalidRequest("'query' must be a non-empty string")
        return cls(models=models, model=model, query=query, documents=docs,
                   **cls._json_args(body, shape, "query", "documents"))

    def to_wire(self, query: np.ndarray, documents: list[np.ndarray]) -> Rerank:
        """The RERANK of the query's token ids and these documents' (a micro-batch of them)."""
        return Rerank(model_ref=self.model, query_n_tokens=len(query),
                      candidates=[{"n_tokens": len(d)} for d in documents],
                      raw=np.concatenate([query, *documents]).astype("<i4").tobytes())


def tei_model(models: SupervisorConfig) -> str:
    """TEI serves one model and its clients name none: the one rerank model, else the one embedding model."""
    for kind in (RERANK, EMBEDDING):  # a cross-encoder before a bi-encoder
        of_kind = [m.id for m in models.models if m.kind == kind]
        if len(of_kind) == 1:
            return of_kind[0]
        if of_kind:
            break
    raise InvalidRequest("'model' is required: more than one model (or none) can rerank here")


def only_model(models: SupervisorConfig, kind: str) -> str:
    """The one model of `kind`, for a route whose clients name none (TEI's /embed, TGI's /generate)."""
    of_kind = [m.id for m in models.models if m.kind == kind]
    if len(of_kind) != 1:
        raise InvalidRequest(f"'model' is required: {len(of_kind)} {kind} models are served here, not one")
    return of_kind[0]


_BOTH = ("completions", "chat")
_TGI_TOP = ("inputs", "stream")  # TGI's body: these at its top level, the rest under `parameters`
_TGI_NEUTRAL: ck.Spec = {  # text-generation-inference's parameters that only their neutral value leaves unchanged
    "stream": ck.only(False, "TGI's token stream is not implemented (stream with /v1/completions)"),
    "best_of": ck.only(1, "one candidate per request"),
    "details": ck.only(False, "token details are not implemented (logprobs with /v1/completions)"),
    "decoder_input_details": ck.only(False, "token details are not implemented"),
    "top_n_tokens": ck.never("token details are not implemented (logprobs with /v1/completions)"),
    "repetition_penalty": ck.only(1, "repetition penalties are not implemented"),
    "frequency_penalty": ck.only(0, "repetition penalties are not implemented"),
    "typical_p": ck.only(1, "typical sampling is not implemented"),
    "watermark": ck.only(False, "watermarking is not implemented"),
    "truncate": ck.never("prompts are never cut"),
    "adapter_id": ck.never("adapters are not implemented"),
}
_ONE_CHOICE: ck.Spec = {  # both completion bodies' fields that only their neutral value leaves unchanged
    "n": ck.only(1, "one choice per request"),
    "frequency_penalty": ck.only(0, "repetition penalties are not implemented"),
    "presence_penalty": ck.only(0, "repetition penalties are not implemented"),
    "logit_bias": ck.only({}, "logit biases are not implemented"),
}


@api_request
class CompletionRequest(ApiRequest):
    """A completion of `prompt` (a string or its token ids), or of `messages` through the model's chat template:
    greedy at temperature 0 (the default), else sampled (seeded: reproducible). `max_tokens` None: until the end
    of generation, a stop string or the model's context, at most the model's `default_max_tokens` when it has one
    (resolved once the prompt is tokenized). `stop`: up to 4 strings that end the text before them. `logprobs`:
    per generated token its log probability and that many alternatives. `echo`: the answer begins with the prompt
    (and with `logprobs`, the prompt's tokens scored, vLLM's way). Bodies: OpenAI's completions and chat
    completions; a completions body's list of prompts is one request each (`from_json_prompts`)."""

    WHAT = "generation"
    NEUTRAL: ClassVar[Mapping[str, ck.Spec]] = {
        "completions": {**_ONE_CHOICE, "best_of": ck.only(1, "one candidate per request"),
                        "suffix": ck.never("insertion is not implemented")},
        "chat": {**_ONE_CHOICE},
        "tgi": _TGI_NEUTRAL,
    }

    prompt: str | list[int] | None = arg(None, body={"completions": ("prompt",), "tgi": ("inputs",)})  # or token ids
    messages: list[dict[str, str]] | None = arg(None, body={"chat": ("messages",)})
    max_tokens: int | None = arg(None, body={"completions": ("max_tokens",),
                                             "chat": ("max_tokens", "max_completion_tokens"),
                                             "tgi": ("max_new_tokens",)})
    grammar: str | None = arg(None)  # Lark or GBNF (docs/http-api.md, 'Structured output')
    response_format: dict[str, Any] | None = arg(None, body={"chat": ("response_format",)})
    tools: list[dict[str, Any]] | None = arg(None, body={"chat": ("tools",)})
    tool_choice: str | dict[str, Any] | None = arg(None, body={"chat": ("tool_choice",)})
    parallel_tool_calls: bool = arg(True, body={"chat": ("parallel_tool_calls",)})  # an answer has at most one
    temperature: float | None = arg(None)
    top_p: float | None = arg(None)
    top_k: int | None = arg(None)
    seed: int | None = arg(None)
    stop: str | list[str] | None = arg(None)
    logprobs: int | None = arg(None, body={"completions": ("logprobs",), "chat": ("logprobs", "top_logprobs")})
    stream: bool = arg(False)  # the HTTP answer as server-sent events
    include_usage: bool = arg(False, body={s: ("stream_options",) for s in _BOTH})  # a streamed answer's usage
    echo: bool = arg(False, body={"completions": ("echo",)})
    user: str | None = arg(None, body={s: ("user",) for s in _BOTH})
    # TGI's: sample (at temperature 1 unless one is given), and the answer's text led by the prompt
    do_sample: bool = arg(False, body={"tgi": ("do_sample",)})
    return_full_text: bool = arg(False, body={"tgi": ("return_full_text",)})
    sampling: dict[str, Any] = derived()  # GENERATE's sampling fields: only those that change the answer
    constraint: str | None = derived()  # GENERATE's grammar: of `grammar`, `response_format` or `tools`
    tool_mode: str = derived()  # "none", "auto" or "call": how the answer's text is read back (_structured.py)
    texts: list[str] = derived()  # what the prompt is made of, for the admission bound
    prompt_ids: list[int] | None = derived()  # a prompt given as token ids (checked against the vocabulary later)

    def _check(self, mc: ModelConfig) -> None:
        context = ck.gen_context(mc)
        if self.max_tokens is not None:
            self._set(max_tokens=ck.check_max_tokens(self.max_tokens, context - 1))
        self._set(grammar=ck.check_text(self.grammar, "grammar") or None, prompt_ids=None)
        self._constrain()
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        self._set(do_sample=ck.check_flag(self.do_sample, "do_sample", False),
                  return_full_text=ck.check_flag(self.return_full_text, "return_full_text", False))
        self._set(sampling=self._sampling(), echo=ck.check_flag(self.echo, "echo", False))
        if self.messages is not None:
            if self.echo:
                raise InvalidRequest("echo takes a prompt, not messages")
            messages = ck.check_messages(self.messages)
            tools = [json.dumps(self.template_tools)] if self.template_tools else []  # rendered into the prompt
            self._set(messages=messages, texts=[t for m in messages for t in m.values()] + tools)
        elif isinstance(self.prompt, list) and self.prompt and all(map(_is_id, self.prompt)):
            if len(self.prompt) >= context:
                raise RequestTooLarge(f"the prompt has {len(self.prompt)} tokens; model {self.model!r}'s context is "
                                      f"{context}")
            self._set(prompt_ids=list(self.prompt), texts=[])
        elif not isinstance(self.prompt, str) or not self.prompt:
            raise InvalidRequest("prompt must be a non-empty string or a non-empty list of token ids")
        else:
            self._set(texts=[self.prompt])
        if self.echo and "logprobs" in self.sampling:  # the prompt's own logprobs, as many alternatives
            self._set(sampling={**self.sampling, "prompt_logprobs": self.sampling["logprobs"]})
        cap, n_chars = ck.gen_char_cap(mc), sum(map(len, self.texts))
        if n_chars > cap:
            raise RequestTooLarge(f"the prompt has {n_chars} characters; model {self.model!r} takes at most {cap}")
        ck.check_unicode(self.texts, "messages" if self.messages is not None else "prompt")
        self._set(stream=ck.check_flag(self.stream, "stream", False),
                  include_usage=ck.check_flag(self.include_usage, "include_usage", False),
                  user=ck.check_text(self.user, "user"))
        if self.echo and self.stream:
            raise UnsupportedField("echo", "is not implemented with stream: true")

    def _constrain(self) -> None:
        """The one grammar of `grammar`, `response_format` or `tools` (at most one of them constrains), checked by
        the grammar engine now, before any token (GrammarRefused, naming the field)."""
        self._set(parallel_tool_calls=ck.check_flag(self.parallel_tool_calls, "parallel_tool_calls", True))
        by_format = None if self.response_format is None else structured.response_format_grammar(self.response_format)
        by_tools, mode = structured.tools_grammar(self.tools, self.tool_choice)
        given = {k: v for k, v in (("grammar", self.grammar), ("response_format", by_format), ("tools", by_tools))
                 if v is not None}
        if len(given) > 1:
            raise InvalidRequest(f"{' and '.join(given)} each constrain the answer: give one of them")
        constraint = None
        if given:
            (field, text), = given.items()
            lark = structured.raw_grammar(text) if field == "grammar" else text
            constraint = structured.check_grammar(lark, field)
        self._set(constraint=constraint, tool_mode=mode)

    def _sampling(self) -> dict[str, Any]:
        """GENERATE's sampling fields, each checked; only those that change the answer (temperature 0 is greedy,
        top_p 1 and top_k 0 cut nothing), so a greedy request is the reference's GENERATE."""
        out: dict[str, Any] = {}
        t = ck.check_number(self.temperature, "temperature", 0.0, 2.0)
        if t is None and self.do_sample:
            t = 1.0
        p = ck.check_number(self.top_p, "top_p", 0.0, 1.0)
        if p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1], got 0")
        k = ck.check_integer(self.top_k, "top_k", 0, 1 << 31)
        seed = ck.check_integer(self.seed, "seed", 0, ck.SEED_BOUND - 1)
        if t:  # greedy: nothing else changes which token comes next
            out["temperature"] = t
            if p is not None and p < 1.0:
                out["top_p"] = p
            if k:
                out["top_k"] = k
            if seed is not None:
                out["seed"] = seed
        if stops := ck.check_stops(self.stop):
            out["stop"] = stops
        if (lp := ck.check_integer(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)) is not None:
            out["logprobs"] = lp
        return out

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template describes to the model: those it may call (none with tool_choice "none")."""
        return self.tools if self.tool_mode != "none" else None

    @property
    def template_bytes(self) -> int:
        """Token-id bytes a chat template may add around the messages (admission's bound)."""
        return CHAT_TEMPLATE_BYTES * len(self.messages or ())

    @classmethod
    def from_json(cls, body: Mapping[str, Any], models: SupervisorConfig, *, shape: str,
                  full_text: bool = False) -> CompletionRequest:
        """OpenAI's bodies ("completions", "chat"), and text-generation-inference's ("tgi": `inputs`, `stream` and
        `parameters`; the one generate model serves it; `full_text`: return_full_text's default, true on TGI's
        `POST /` for a text-generation model)."""
        if shape == "tgi":
            body = cls._unnested(body, shape, _TGI_TOP)
            args = cls._json_args(body, shape, "prompt")
            args.setdefault("return_full_text", full_text)
            prompt = body.get("inputs")
            return cls(models=models, model=only_model(models, GENERATE),
                       **({"prompt": prompt} if prompt is not None else {}), **args)
        model = cls.json_model(body, models)
        stream, include_usage = _stream_flags(body)
        if shape == "chat":
            given = {"messages": _json_messages(body.get("messages")), "logprobs": _chat_logprobs(body)}
        else:
            given = {"prompt": body.get("prompt")}
        args = cls._json_args(body, shape, *given, "stream", "include_usage")
        args.update((k, v) for k, v in given.items() if v is not None)
        return cls(models=models, model=model, stream=stream, include_usage=include_usage, **args)

    @classmethod
    def from_json_prompts(cls, body: Mapping[str, Any], models: SupervisorConfig, *,
                          max_inputs: int) -> list[CompletionRequest]:
        """A completions body's requests, one per prompt, as vLLM takes `prompt`: a string, a list of token ids,
        or a list of either (each its own choice, `index` in order). A stream takes one prompt."""
        cls.json_model(body, models)  # an unknown model is 404 before any other check
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(_is_id, prompt))):
            prompts: list[Any] = [prompt]
        else:
            prompts = json_list(prompt, "prompt", max_inputs, ids=True)
            for i, p in enumerate(prompts):
                if not isinstance(p, str | list):
                    raise InvalidRequest(f"prompt[{i}] must be a string or a list of token ids")
        if len(prompts) > 1 and ck.check_flag(body.get("stream"), "'stream'", False):
            raise InvalidRequest("a stream takes one prompt: send a list of prompts without 'stream'")
        return [cls.from_json({**body, "prompt": p}, models, shape="completions") for p in prompts]

    def to_wire(self, ids: np.ndarray, max_tokens: int, *, stream: bool) -> Generate:
        """The GENERATE of the prompt's token ids and up to `max_tokens` new ones (the request's, or its default
        resolved against the prompt); `stream`: TEXT_DELTAs as the text is generated."""
        return Generate(model_ref=self.model, max_tokens=max_tokens, grammar=self.constraint,
                        stream=True if stream else None, **self.sampling, raw=ids.astype("<i4").tobytes())


def _stream_flags(body: Mapping[str, Any]) -> tuple[Any, bool]:
    """(stream, include_usage): `stream_options` only with `stream: true`, and only its known keys."""
    stream = ck.check_flag(body.get("stream"), "'stream'", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise UnsupportedField(f"stream_options.{key}", "is not a field this daemon implements")
    return stream, ck.check_flag(options.get("include_usage"), "'stream_options.include_usage'", False)


def _chat_logprobs(body: Mapping[str, Any]) -> Any:
    """Chat's `logprobs: true` and `top_logprobs: n` as the request's `logprobs: n`."""
    want = ck.check_flag(body.get("logprobs"), "'logprobs'", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    return (top if top is not None else 0) if want else None


def _json_messages(raw: Any) -> Any:
    """Chat messages with content parts (text only) joined into their content; each message's and part's fields
    checked. Their shape is the request's check."""
    if not isinstance(raw, list):
        return raw
    messages = []
    for i, m in enumerate(raw):
        if isinstance(m, dict):
            ck.check_fields(m, MESSAGE, f"messages[{i}].")
            m = {**m, "content": _joined_parts(m.get("content"), i)}
        messages.append(m)
    return messages


def _joined_parts(content: Any, i: int) -> Any:
    if not isinstance(content, list):
        return content
    for k, part in enumerate(content):
        if isinstance(part, dict):
            ck.check_fields(part, CONTENT_PART, f"messages[{i}].content[{k}].")
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
    return "".join(p["text"] for p in content)


__all__ = [
    "ApiRequest",
    "CompletionRequest",
    "EmbeddingsRequest",
    "OnDelta",
    "RerankRequest",
    "configured_model",
    "embed_batch",
    "only_model",
    "serving_model",
    "tei_model",
]
