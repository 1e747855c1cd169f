"""`POST /v1/responses` through the official `openai` client: a tiny model that spells ASCII
(so JSON and tool calls can be written), in-process; the reasoning parser with a scripted
engine (tiny models cannot be made to write `<think>`), as test_reasoning.py does.

After each test on the tiny model the engine is idle with its KV blocks free (/metrics).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai_testing import RunningServer, parse_metrics, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app
from asyncengine.errors import EngineDeadError
from asyncengine.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.timeout(240)

OPENAI_ASYNCGEN_WARNINGS = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "A city's weather",
        "parameters": WEATHER,
    },
    {"type": "function", "name": "add", "parameters": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = "What is the weather in Paris?"
GREEDY: dict[str, Any] = dict(
    model="tiny", temperature=0, max_output_tokens=12, extra_body={"ignore_eos": True}
)
SAMPLED: dict[str, Any] = dict(model="tiny", temperature=1.0, max_output_tokens=300)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


def _chat_model(
    factory: Callable[..., Path], tmp: pytest.TempPathFactory, template: str, name: str
) -> Path:
    model = factory("llama", tokenizer="ascii", max_position_embeddings=2048)
    path = tmp.mktemp(name) / "model"
    shutil.copytree(model, path)
    (path / "chat_template.jinja").write_text(template)
    return path


@pytest.fixture(scope="module")
def tiny(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    path = _chat_model(tiny_model_factory, tmp_path_factory, CHAT_TEMPLATE, "responses-chat")
    engine = AsyncLLM.from_pretrained(
        path, device="cpu", core="thread", dtype="float32", max_model_len=1024, seed=0
    )
    with run_in_thread(build_app(engine, served_model_name="tiny")) as running:
        yield running


def _is_idle(server: RunningServer) -> bool:
    response = httpx.get(server.url + "/metrics", timeout=30)
    m = parse_metrics(response.text)
    return (
        m["asyncengine_num_requests_running"] == 0
        and m["asyncengine_num_requests_waiting"] == 0
        and m["asyncengine_kv_cache_usage_perc"] == 0.0
    )


@pytest.fixture
def client(tiny: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c
    deadline = time.monotonic() + 10
    while not _is_idle(tiny):  # every request ended, every KV block free again
        assert time.monotonic() < deadline, "the engine never got idle"
        time.sleep(0.01)
    assert not tiny.state.in_flight


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    """Every event of `responses.stream(...)`, and its get_final_response()."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, final


def _summary(response: Any) -> list[tuple[Any, ...]]:
    """A response's output without its ids: what must be equal, streamed or not."""
    usage = response.usage  # (cached_tokens differ: the second run hits the prefix cache)
    counts = (usage.input_tokens, usage.output_tokens, usage.total_tokens)
    summary: list[tuple[Any, ...]] = [
        (response.status, counts, usage.output_tokens_details.reasoning_tokens)
    ]
    for item in response.output:
        if item.type == "message":
            summary.append(("message", item.status, [c.text for c in item.content]))
        elif item.type == "function_call":
            summary.append(("function_call", item.name, item.arguments, item.status))
        else:
            summary.append(("reasoning", [c.text for c in item.content or []]))
    return summary


def _check_order(events: list[Any]) -> None:
    """Lifecycle first and last; every item added, then its parts, deltas and done events."""
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and types.count("response.completed") == 1
    open_items: dict[int, str] = {}
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert not open_items, "one item at a time"
            open_items[event.output_index] = event.item.type
        elif event.type == "response.output_item.done":
            assert open_items.pop(event.output_index) == event.item.type
        else:
            assert event.output_index in open_items, event.type
    assert not open_items


# ---- text ------------------------------------------------------------------------------------


def test_a_string_input_answers_with_a_message(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hello there", **GREEDY)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny"
    assert out.status == "incomplete"  # cut off by max_output_tokens
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    assert out.output_text and out.output_text == message.content[0].text
    # The prompt is chat's for the same message, and so is the greedy answer.
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and out.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert out.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.store is False and out.tools == [] and out.tool_choice == "none"


def test_stream_equals_the_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "?"}]},
        ],
        **GREEDY,
    )
    out = client.responses.create(**kw)
    events, final = _streamed(client, **kw)
    _check_order(events)
    types = [e.type for e in events]
    assert types[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == out.output_text == final.output_text
    assert _summary(final) == _summary(out)
    assert final.instructions == "Answer briefly."
    # The same events through create(stream=True) (text pieces may merge differently: a
    # stream whose client reads late gets fewer, longer deltas).
    with client.responses.create(stream=True, **kw) as stream:
        again = list(stream)
    assert _runs([e.type for e in again]) == _runs(types)
    assert "".join(e.delta for e in again if e.type == "response.output_text.delta") == "".join(
        deltas
    )


def _runs(types: list[str]) -> list[str]:
    """Event types with each run of deltas as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and types[i - 1] == t)]


@OPENAI_ASYNCGEN_WARNINGS
async def test_async_stream(tiny: RunningServer) -> None:
    async with openai.AsyncOpenAI(
        base_url=tiny.base_url, api_key="none", max_retries=0, timeout=60
    ) as client:
        out = await client.responses.create(input="Hello", **GREEDY)
        async with client.responses.stream(input="Hello", **GREEDY) as stream:
            texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert "".join(texts) == out.output_text == final.output_text
    assert _summary(final) == _summary(out)


def test_the_raw_stream_names_each_event(tiny: RunningServer) -> None:
    body = {"model": "tiny", "input": "Hello", "stream": True, "max_output_tokens": 4}
    response = httpx.post(tiny.base_url + "/responses", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n") and "[DONE]" not in response.text
    blocks = response.text[:-2].split("\n\n")
    for n, block in enumerate(blocks):
        kind, data = block.split("\n")  # `event: TYPE`, then one `data: {json}` line
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}" and event["sequence_number"] == n
    assert json.loads(blocks[-1].split("\n")[1][6:])["type"] == "response.completed"


def _generated(server: RunningServer) -> float:
    metrics = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    return metrics["asyncengine_generation_tokens_total"]


def test_a_client_that_leaves_mid_stream_aborts_its_request(
    client: openai.OpenAI, tiny: RunningServer
) -> None:
    before = _generated(tiny)
    kw: dict[str, Any] = dict(GREEDY, max_output_tokens=900)
    with client.responses.stream(input="Hello", **kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break  # leaves: the `client` fixture then waits for every KV block to be free
    deadline = time.monotonic() + 10
    while tiny.state.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _generated(tiny) - before < 900  # aborted, not run to its end


async def test_503_while_the_engine_is_not_running(chat_model: Path) -> None:
    app = build_app(chat_model, core="thread", device="cpu", dtype="float32", max_model_len=512)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post("/v1/responses", json={"input": "hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == 503


def test_store_is_accepted_and_nothing_is_stored(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hello", store=True, **GREEDY)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):  # no GET /v1/responses/{id}
        client.responses.retrieve(out.id)


# ---- tools -----------------------------------------------------------------------------------


def _assert_calls(response: Any) -> list[tuple[str, dict[str, Any]]]:
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    result = []
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.name])
        result.append((call.name, arguments))
    return result


def test_a_named_function_is_called_and_streams_its_arguments(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "add"},
        extra_body={"seed": 3},
        **SAMPLED,
    )
    out = client.responses.create(**kw)
    assert out.status == "completed"
    [(name, arguments)] = _assert_calls(out)
    assert name == "add" and out.output_text == ""
    assert out.tool_choice.type == "function" and out.tool_choice.name == "add"  # type: ignore[union-attr]
    events, final = _streamed(client, **kw)
    _check_order(events)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2  # the arguments arrive piece by piece
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == arguments == json.loads("".join(deltas))
    assert _summary(final) == _summary(out)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate_and_stream_the_same(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(2):
        kw: dict[str, Any] = dict(
            input=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            extra_body={"seed": seed},
            **SAMPLED,
        )
        out = client.responses.create(**kw)
        calls = _assert_calls(out)
        assert parallel or len(calls) == 1
        assert out.parallel_tool_calls is parallel
        _, final = _streamed(client, **kw)
        assert _summary(final) == _summary(out)


def test_a_tool_result_goes_back_in_the_input(client: openai.OpenAI, tiny: RunningServer) -> None:
    first = client.responses.create(
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "add"},
        extra_body={"seed": 3},
        **SAMPLED,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    items: list[Any] = [{"role": "user", "content": ASK}, *first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
    out = client.responses.create(input=items, tools=TOOLS, **GREEDY)
    assert out.output and out.status == "incomplete"
    # The call and its result were shown to the model (written as <tool_call> text, since
    # this template does not take tools).
    assert out.usage is not None and out.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


# ---- structured outputs ----------------------------------------------------------------------


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = Person.model_json_schema()
    fmt: Any = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    out = client.responses.create(
        input="Invent a person.", text={"format": fmt}, extra_body={"seed": 1}, **SAMPLED
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text is not None and out.text.format is not None
    assert out.text.format.type == "json_schema"
    parsed = client.responses.parse(
        input="Invent a person.", text_format=Person, extra_body={"seed": 2}, **SAMPLED
    )
    assert isinstance(parsed.output_parsed, Person)


def test_text_format_json_object_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        input="Some JSON please", text={"format": {"type": "json_object"}}, **SAMPLED
    )
    kw["extra_body"] = {"seed": 1}
    out = client.responses.create(**kw)
    assert isinstance(json.loads(out.output_text), dict)
    _, final = _streamed(client, **kw)
    assert _summary(final) == _summary(out)


# ---- bad requests ----------------------------------------------------------------------------

LONG = "word " * 400  # over 1024 tokens of the ASCII tokenizer
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"input": 42}, "input", "invalid request body"),
    ({}, "input", "missing required field"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["hi"]}, "input[0]", "must be an object"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type", "not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "stores no items"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "must be a string"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "input_image",
    ),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", "call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text",
     "must be a string"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        "input[0]",
        "arguments must be a string",
    ),
    ({"input": "hi", "instructions": 5}, "instructions", "invalid request body"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stores no"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "stores no"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "auto"),
    ({"input": LONG}, "input", "maximum context length"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens=0"),
    ({"input": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "yaml"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format", "invalid"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "schema"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools",
     "JSON schema object"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "nope"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice", "text.format"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_400_naming_the_field(
    client: openai.OpenAI, tiny: RunningServer, stream: bool
) -> None:
    # Raw bodies (the client would refuse some), streamed too: refused before any stream.
    with httpx.Client(base_url=tiny.base_url + "/", timeout=60) as http:
        for body, param, named in BAD:
            response = http.post("responses", json={"model": "tiny", "stream": stream, **body})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400
            assert error["param"] == param, (body, error)
            assert named in error["message"], (body, error)
        response = http.post("responses", json={"model": "other", "input": "hi"})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    # The server goes on.
    assert client.responses.create(input="hi", **GREEDY).output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_does_not_compile_is_400(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="tiny", input="hi", text={"format": fmt}, stream=stream, max_output_tokens=4
        )  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "text.format"
    assert "text.format.schema could not be compiled" in body["message"]
    assert client.responses.create(input="hi", **GREEDY).output_text


# ---- reasoning, with scripted outputs --------------------------------------------------------


class Script:
    """What the scripted engine writes next: text pieces (each one DELTA output)."""

    def __init__(self) -> None:
        self.pieces: list[str] = ["ok"]
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []
        self.error: Exception | None = None  # raised after the pieces, instead of finishing

    def __call__(
        self, *pieces: str, finish_reason: str = "stop", error: Exception | None = None
    ) -> None:
        self.pieces, self.finish_reason, self.error = list(pieces), finish_reason, error

    async def generate(
        self, prompt: Any, params: Any, *, request_id: str | None = None, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        token_ids = list(prompt)
        self.prompts.append(token_ids)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1 and self.error is None
            finish = self.finish_reason if last else None
            completion = CompletionOutput(0, piece, [1], finish_reason=finish)
            yield RequestOutput(request_id or "", None, token_ids, [completion], finished=last)
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def think_model(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return _chat_model(tiny_model_factory, tmp_path_factory, THINK_TEMPLATE, "responses-think")


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def qwen3(think_model: Path, script: Script) -> Iterator[RunningServer]:
    engine = AsyncLLM.from_pretrained(
        think_model, device="cpu", core="thread", dtype="float32", max_model_len=1024
    )
    engine.generate = script.generate  # type: ignore[method-assign, assignment]
    app = build_app(engine, served_model_name="tiny", reasoning_parser="qwen3")
    with run_in_thread(app) as running:
        yield running


@pytest.fixture
def qclient(qwen3: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=qwen3.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_reasoning_item_then_message(qclient: openai.OpenAI, script: Script) -> None:
    script("<th", "ink>Let ", "me see.</", "thi", "nk>\n\nIt", " is 4.")
    out = qclient.responses.create(model="tiny", input="2 + 2?")
    assert out.status == "completed" and out.incomplete_details is None
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None and reasoning.content[0].text == "Let me see."
    assert reasoning.content[0].type == "reasoning_text" and reasoning.summary == []
    assert message.type == "message" and out.output_text == "\n\nIt is 4."
    assert out.usage is not None and out.usage.output_tokens == 6
    # The deltas inside the thinking: "ink>Let ", "me see.</", "thi"
    assert out.usage.output_tokens_details.reasoning_tokens == 3

    events, final = _streamed(qclient, model="tiny", input="2 + 2?")
    _check_order(events)
    assert _summary(final) == _summary(out)
    reasoning_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(reasoning_deltas) == "Let me see."
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "Let me see."
    types = [e.type for e in events]
    assert types.index("response.output_item.done") < types.index("response.output_text.delta")
    texts = [e.delta for e in events if e.type.endswith(".delta")]
    assert not any("<" in t for t in texts)


def test_thinking_cut_off_is_an_incomplete_reasoning_item(
    qclient: openai.OpenAI, script: Script
) -> None:
    script("<think>So the", " user asks", finish_reason="length")
    out = qclient.responses.create(model="tiny", input="2 + 2?", max_output_tokens=2)
    assert out.status == "incomplete" and out.output_text == ""
    [reasoning] = out.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    _, final = _streamed(qclient, model="tiny", input="2 + 2?", max_output_tokens=2)
    assert _summary(final) == _summary(out)


def test_items_reach_the_template(
    qclient: openai.OpenAI, script: Script, qwen3: RunningServer
) -> None:
    script("Fine.")
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    out = qclient.responses.create(
        model="tiny",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use Celsius."},
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "C"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[tool],  # type: ignore[list-item]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert out.output_text == "Fine."
    prompt = qwen3.state.engine.tokenizer.decode(script.prompts[-1])
    # (the tiny tokenizer spells printable ASCII only: the new lines are gone)
    assert prompt.startswith("system: Be brief.You can call these tools")
    assert "system: Use Celsius.user: Weather?assistant: <tool_call>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in (
        prompt
    )
    assert "tool: sunny" in prompt and prompt.endswith("assistant:<think></think>")


def test_an_error_mid_stream_is_an_error_event_then_failed(
    qclient: openai.OpenAI, script: Script
) -> None:
    script("It", " is", error=EngineDeadError("the core died"))
    with qclient.responses.stream(model="tiny", input="2 + 2?") as stream:
        events: list[Any] = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-2:] == ["error", "response.failed"], types
    assert "the core died" in events[-2].message and events[-2].code == "503"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert "the core died" in failed.error.message
    with pytest.raises(openai.InternalServerError):  # 503, not streamed
        qclient.responses.create(model="tiny", input="2 + 2?")
    script("ok")


def test_a_constraint_with_thinking_on_is_refused(qclient: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        qclient.responses.create(model="tiny", input="hi", text={"format": {"type": "json_object"}})
    assert info.value.param == "text.format"  # type: ignore[attr-defined]
    assert "reasoning parser (qwen3)" in str(info.value)


def test_real_engine_with_a_parser(think_model: Path) -> None:
    engine = AsyncLLM.from_pretrained(
        think_model, device="cpu", core="thread", dtype="float32", max_model_len=1024, seed=0
    )
    app = build_app(engine, served_model_name="tiny", reasoning_parser="qwen3")
    with (
        run_in_thread(app) as running,
        openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0) as client,
    ):
        # Sampled: greedy, the tiny model writes tokens that decode to ''.
        seeded: dict[str, Any] = dict(GREEDY, temperature=1.0, extra_body={"seed": 3})
        out = client.responses.create(input="Hello", **seeded)
        _, final = _streamed(client, input="Hello", **seeded)
    # Random text of a tiny model holds no <think>: one message, no reasoning.
    assert [item.type for item in out.output] == ["message"] and out.output_text
    assert out.usage is not None and out.usage.output_tokens_details.reasoning_tokens == 0
    assert _summary(final) == _summary(out)
