"""Structured output through the real client libraries, unmodified, against a real daemon serving a tiny random
model: the `openai` SDK's `chat.completions.parse` with a pydantic model and `tools` with a forced function,
instructor in its TOOLS, JSON and JSON_SCHEMA modes, and LangChain's `ChatOpenAI.with_structured_output`
(json_schema and function_calling) and `bind_tools`. Whatever the
random model writes under the constraint, the client parses it into the pydantic model it asked for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import instructor
import openai
import pytest
from instructor.core.exceptions import InstructorError
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.support.daemon_process import TINY_LM, tiny_daemon

pytestmark = pytest.mark.slow
MAX_TOKENS = 300
ASK = [{"role": "user", "content": "Who is on call?"}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas are
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    team: Literal["red", "blue"]
    admin: bool


class GetWeather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=8)
    unit: Literal["C", "F"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with tiny_daemon(tmp_path_factory.mktemp("clients")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat_model(base: str, **kwargs: object) -> ChatOpenAI:
    return ChatOpenAI(base_url=base + "/v1", api_key="unused", model=TINY_LM, max_tokens=MAX_TOKENS,
                      max_retries=0, timeout=120, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI, temperature: float) -> None:
    out = client.chat.completions.parse(model=TINY_LM, messages=ASK, response_format=Person, max_tokens=MAX_TOKENS,
                                        temperature=temperature, seed=5)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Person) and msg.parsed == Person.model_validate_json(msg.content)
    with client.chat.completions.stream(model=TINY_LM, messages=ASK, response_format=Person, max_tokens=MAX_TOKENS,
                                        temperature=temperature, seed=5) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.parsed == msg.parsed  # greedy, or the same seed: the same answer, streamed


def test_openai_tools_with_a_forced_function(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    out = client.chat.completions.create(model=TINY_LM, messages=ASK, max_tokens=MAX_TOKENS, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    GetWeather.model_validate_json(call.function.arguments)
    # parse() reads the arguments back into the model; a stream's deltas add up to the same call
    parsed = client.chat.completions.parse(model=TINY_LM, messages=ASK, max_tokens=MAX_TOKENS, tools=[tool],
                                           tool_choice="required")
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(model=TINY_LM, messages=ASK, max_tokens=MAX_TOKENS, tools=[tool],
                                        tool_choice="required") as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)  # greedy: the same call
    assert isinstance(streamed.function.parsed_arguments, GetWeather)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor(client: openai.OpenAI, mode: instructor.Mode) -> None:
    """instructor's schema-bound modes: a forced tool call (TOOLS) and `response_format: json_schema`
    (JSON_SCHEMA); no retry, so the first answer must validate."""
    patched = instructor.from_openai(client, mode=mode)
    person = patched.chat.completions.create(model=TINY_LM, messages=ASK, response_model=Person,
                                             max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    assert isinstance(person, Person)


def test_instructor_json_mode_gets_a_json_object(client: openai.OpenAI) -> None:
    """instructor's JSON mode asks for `response_format: json_object` and puts the schema in a system message: the
    daemon constrains the answer to a JSON object (it was a 400 before); whether that object is a Person is the
    model's to follow, and a random model does not, so instructor's own validation error is the expected end."""
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON)
    with pytest.raises(InstructorError) as info:
        patched.chat.completions.create(model=TINY_LM, messages=ASK, response_model=Person,
                                        max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    completion = info.value.last_completion  # type: ignore[attr-defined]
    choice = completion.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(base: str, method: str) -> None:
    person = chat_model(base, temperature=0).with_structured_output(Person, method=method).invoke(ASK[0]["content"])
    assert isinstance(person, Person)


def test_langchain_bind_tools(base: str) -> None:
    reply = chat_model(base, temperature=0).bind_tools([GetWeather], tool_choice="required").invoke(
        "What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and isinstance(GetWeather.model_validate(call["args"]), GetWeather)
