"""`serve --reasoning-parser`: a model's `<think>` thinking split into `reasoning_content`.

The parsers on their own (whole outputs, and deltas split at every position); then the chat
endpoint through the official `openai` client: tiny models cannot be made to write `<think>`,
so a scripted engine (the real AsyncLLM, whose `generate` yields chosen text) drives the
server's path, and one test runs the real engine with the parser on.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai_testing import RunningServer, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints import cli
from asyncengine.entrypoints.openai import build_app
from asyncengine.entrypoints.openai.reasoning import REASONING_PARSERS, reasoning_parser
from asyncengine.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.timeout(120)

OPENAI_ASYNCGEN_WARNINGS = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)

# Qwen3's convention: the model opens <think> itself; with enable_thinking false the template
# writes an empty block, so the output is the answer.
THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]

# ---- the parsers -----------------------------------------------------------------------------

# (parser, prompt's end, output) → (reasoning, content)
CASES: list[tuple[str, str, str, tuple[str | None, str | None]]] = [
    ("qwen3", "", "<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
    ("qwen3", "", "\n<think>a</think>b", ("a", "b")),
    ("qwen3", "", "It is 4.", (None, "It is 4.")),
    ("qwen3", "", "It is <think>4</think>.", (None, "It is <think>4</think>.")),
    ("qwen3", "", "<think>cut off by max_tokens", ("cut off by max_tokens", None)),
    ("qwen3", "", "<think>ends in a partial </thi", ("ends in a partial </thi", None)),
    ("qwen3", "", "<thin", (None, "<thin")),
    ("qwen3", "", "<think></think>", (None, None)),
    ("qwen3", "assistant: <think>\n", "thinking</think>answer", ("thinking", "answer")),
    ("qwen3", "<think>\n\n</think>\n\n", "<think>x</think>y", (None, "<think>x</think>y")),
    ("deepseek_r1", "", "thinking</think>answer", ("thinking", "answer")),
    ("deepseek_r1", "", "<think>thinking</think>answer", ("thinking", "answer")),
    ("deepseek_r1", "", "still thinking", ("still thinking", None)),
    ("deepseek_r1", "", "a < b </ c </think>d", ("a < b </ c ", "d")),
    ("deepseek_r1", "", "one</think>two</think>", ("one", "two</think>")),
    ("deepseek_r1", "<think>\n\n</think>\n\n", "Hello", (None, "Hello")),
]


@pytest.mark.parametrize(("name", "prompt", "output", "expected"), CASES)
def test_whole_output(
    name: str, prompt: str, output: str, expected: tuple[str | None, str | None]
) -> None:
    parser = REASONING_PARSERS[name]
    assert parser.extract(output, prompt) == expected


@pytest.mark.parametrize(("name", "prompt", "output", "expected"), CASES)
def test_deltas_split_anywhere_give_the_same_split_and_never_a_tag(
    name: str, prompt: str, output: str, expected: tuple[str | None, str | None]
) -> None:
    parser = REASONING_PARSERS[name]
    splits = [[i, j] for i, j in itertools.combinations(range(len(output) + 1), 2)]
    splits.append(list(range(len(output) + 1)))  # one character at a time
    for cuts in splits:
        bounds = [0, *cuts, len(output)]
        pieces = [output[a:b] for a, b in itertools.pairwise(bounds)]
        stream = parser.stream(prompt)
        sent = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        reasoning = "".join(r for r, _ in sent) or None
        content = "".join(c for _, c in sent) or None
        assert (reasoning, content) == expected, pieces
        # Reasoning is sent only before any content.
        first_content = next((k for k, (_, c) in enumerate(sent) if c), len(sent))
        assert not any(r for r, _ in sent[first_content + 1 :]), pieces


def test_a_partial_tag_is_held_until_it_resolves() -> None:
    stream = REASONING_PARSERS["qwen3"].stream("")
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>Hmm") == ("Hmm", "")
    assert stream.feed(" ok</thi") == (" ok", "")
    assert stream.feed("nk>Yes") == ("", "Yes")


def test_unknown_parser_names_the_known_ones() -> None:
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match=r"'nope'.*deepseek_r1, qwen3"):
        reasoning_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        build_app("does-not-matter", reasoning_parser="nope")


def test_serve_refuses_an_unknown_parser_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["serve", "no-such-model", "--reasoning-parser", "nope"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "deepseek_r1, qwen3" in err and "nope" in err, err


def test_serve_help_names_every_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--reasoning-parser" in text
    assert all(name in text for name in REASONING_PARSERS)


# ---- through the server, with scripted outputs ----------------------------------------------


class Script:
    """What the scripted engine writes next: text pieces (each one DELTA output)."""

    def __init__(self) -> None:
        self.pieces: list[str] = ["ok"]
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []

    def __call__(self, *pieces: str, finish_reason: str = "stop") -> None:
        self.pieces, self.finish_reason = list(pieces), finish_reason

    async def generate(
        self, prompt: Any, params: Any, *, request_id: str | None = None, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        token_ids = list(prompt)
        self.prompts.append(token_ids)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            finish = self.finish_reason if last else None
            completion = CompletionOutput(0, piece, [1], finish_reason=finish)
            yield RequestOutput(request_id or "", None, token_ids, [completion], finished=last)


@pytest.fixture(scope="module")
def think_model(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    model = tiny_model_factory("llama", tokenizer="ascii", max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("think-chat") / "model"
    shutil.copytree(model, path)
    (path / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return path


def _scripted_server(path: Path, parser: str, script: Script) -> Iterator[RunningServer]:
    engine = AsyncLLM.from_pretrained(
        path, device="cpu", core="thread", dtype="float32", max_model_len=1024
    )
    engine.generate = script.generate  # type: ignore[method-assign]
    app = build_app(engine, served_model_name="tiny", reasoning_parser=parser)
    with run_in_thread(app) as running:
        yield running


@pytest.fixture(scope="module")
def qwen3_script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def r1_script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def qwen3_server(think_model: Path, qwen3_script: Script) -> Iterator[RunningServer]:
    yield from _scripted_server(think_model, "qwen3", qwen3_script)


@pytest.fixture(scope="module")
def r1_server(think_model: Path, r1_script: Script) -> Iterator[RunningServer]:
    yield from _scripted_server(think_model, "deepseek_r1", r1_script)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], str | None]:
    """The deltas of a streamed chat, and its finish reason."""
    deltas, finish = [], None
    with client.chat.completions.create(model="tiny", messages=ASK, stream=True, **kwargs) as s:
        for chunk in s:
            for choice in chunk.choices:
                deltas.append(choice.delta)
                finish = choice.finish_reason or finish
    return deltas, finish


def _joined(deltas: list[Any], name: str) -> str | None:
    return "".join(getattr(d, name, None) or "" for d in deltas) or None


def test_message_has_reasoning_content_and_content(
    qwen3_server: RunningServer, qwen3_script: Script
) -> None:
    qwen3_script(*"<think>Let me see.</think>\n\nIt is 4.")  # one character per delta
    with _client(qwen3_server) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK)
    message = out.choices[0].message
    assert message.content == "\n\nIt is 4."
    assert message.reasoning_content == "Let me see."  # type: ignore[attr-defined]
    assert message.reasoning == "Let me see."  # type: ignore[attr-defined]
    assert out.choices[0].finish_reason == "stop"


def test_stream_sends_reasoning_then_content_and_never_a_tag(
    qwen3_server: RunningServer, qwen3_script: Script
) -> None:
    qwen3_script("<th", "ink>Let ", "me see.</", "thi", "nk>\n\nIt", " is 4.")
    with _client(qwen3_server) as client:
        deltas, finish = _stream(client)
    assert _joined(deltas, "reasoning_content") == "Let me see."
    assert _joined(deltas, "reasoning") == "Let me see."
    assert _joined(deltas, "content") == "\n\nIt is 4."
    assert finish == "stop"
    kinds = [
        "r" if getattr(d, "reasoning_content", None) else "c"
        for d in deltas
        if getattr(d, "reasoning_content", None) or d.content
    ]
    assert kinds == sorted(kinds, reverse=True), kinds  # every reasoning delta comes first
    for d in deltas:
        for text in (d.content, getattr(d, "reasoning_content", None)):
            assert "<" not in (text or ""), deltas


@OPENAI_ASYNCGEN_WARNINGS
async def test_async_stream_without_a_think_block_is_all_content(
    qwen3_server: RunningServer, qwen3_script: Script
) -> None:
    qwen3_script("It", " is", " 4.")
    async with openai.AsyncOpenAI(
        base_url=qwen3_server.base_url, api_key="none", max_retries=0, timeout=60
    ) as client:
        stream = await client.chat.completions.create(model="tiny", messages=ASK, stream=True)
        async with stream:
            deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert _joined(deltas, "content") == "It is 4."
    assert _joined(deltas, "reasoning_content") is None


def test_thinking_cut_off_by_max_tokens_stays_reasoning(
    r1_server: RunningServer, r1_script: Script
) -> None:
    r1_script("So the", " user asks", " </thi", finish_reason="length")
    with _client(r1_server) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK)
        deltas, finish = _stream(client)
    message = out.choices[0].message
    assert message.content is None
    assert message.reasoning_content == "So the user asks </thi"  # type: ignore[attr-defined]
    assert out.choices[0].finish_reason == "length"
    assert _joined(deltas, "reasoning_content") == "So the user asks </thi"
    assert _joined(deltas, "content") is None
    assert finish == "length"


def test_deepseek_r1_takes_text_before_a_lone_end_tag_as_reasoning(
    r1_server: RunningServer, r1_script: Script
) -> None:
    r1_script("The user", " wants 2+2.</think>", "4")
    with _client(r1_server) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK)
        deltas, _ = _stream(client)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants 2+2.", "4")  # type: ignore[attr-defined]
    assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == (
        "The user wants 2+2.",
        "4",
    )


def test_enable_thinking_false_reaches_the_template(
    r1_server: RunningServer, r1_script: Script
) -> None:
    # The template writes an empty think block: the whole output is the answer, even for
    # deepseek_r1, which otherwise takes an output that does not open with <think> as thinking.
    r1_script("Hello")
    with _client(r1_server) as client:
        out = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        prompt = r1_server.state.engine.tokenizer.decode(r1_script.prompts[-1])
        # (the tiny tokenizer spells printable ASCII only: the new lines are gone)
        assert prompt.endswith("assistant:<think></think>")
        assert out.choices[0].message.content == "Hello"
        assert out.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
        client.chat.completions.create(model="tiny", messages=ASK)
        prompt = r1_server.state.engine.tokenizer.decode(r1_script.prompts[-1])
        assert prompt.endswith("assistant:")


WEATHER_TOOL: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_calls_are_parsed_from_the_answer_only(
    qwen3_server: RunningServer, qwen3_script: Script
) -> None:
    with _client(qwen3_server) as client:
        # A call written in the thinking is no call.
        qwen3_script("<think>I could write ", CALL, "</think>", "No need: it is sunny.")
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER_TOOL)
        message = out.choices[0].message
        assert message.tool_calls is None and out.choices[0].finish_reason == "stop"
        assert message.content == "No need: it is sunny."
        assert message.reasoning_content == "I could write " + CALL  # type: ignore[attr-defined]
        deltas, finish = _stream(client, tools=WEATHER_TOOL)
        assert finish == "stop" and not any(d.tool_calls for d in deltas)
        assert _joined(deltas, "content") == "No need: it is sunny."

        # A call in the answer is one, streamed or not.
        qwen3_script("<think>Ask the ", "tool.</think>\n", CALL[:20], CALL[20:])
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER_TOOL)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert message.reasoning_content == "Ask the tool."  # type: ignore[attr-defined]
        assert message.tool_calls is not None
        call = message.tool_calls[0].function  # type: ignore[union-attr]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        deltas, finish = _stream(client, tools=WEATHER_TOOL)
        assert finish == "tool_calls"
        assert _joined(deltas, "reasoning_content") == "Ask the tool."
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("field", "extra"),
    [
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("structured_outputs", {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}),
        ("tool_choice", {"tools": WEATHER_TOOL, "tool_choice": "required"}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_with_thinking_on_is_refused(
    qwen3_server: RunningServer, field: str, extra: dict[str, Any], stream: bool
) -> None:
    with _client(qwen3_server) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, stream=stream, **extra)
    assert info.value.param == field  # type: ignore[attr-defined]
    message = str(info.value)
    assert (
        field in message and "reasoning parser (qwen3)" in message and "enable_thinking" in message
    )


def test_a_constraint_with_thinking_off_is_accepted(
    qwen3_server: RunningServer, qwen3_script: Script
) -> None:
    qwen3_script('{"a": 1}')
    with _client(qwen3_server) as client:
        out = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_object"},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert out.choices[0].message.content == '{"a": 1}'


def test_the_server_stays_up_after_bad_requests(qwen3_server: RunningServer) -> None:
    body = {"model": "tiny", "messages": ASK, "chat_template_kwargs": "not a dict"}
    response = httpx.post(qwen3_server.base_url + "/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert httpx.get(qwen3_server.url + "/health", timeout=30).status_code == 200


# ---- the real engine -------------------------------------------------------------------------


def test_real_engine_with_a_parser_answers_with_content(think_model: Path) -> None:
    engine = AsyncLLM.from_pretrained(
        think_model, device="cpu", core="thread", dtype="float32", max_model_len=1024, seed=0
    )
    app = build_app(engine, served_model_name="tiny", reasoning_parser="qwen3")
    seeded: dict[str, Any] = dict(  # greedy, the tiny model writes tokens that decode to ''
        model="tiny", messages=ASK, max_tokens=8, seed=3, extra_body={"ignore_eos": True}
    )
    with run_in_thread(app) as running, _client(running) as client:
        out = client.chat.completions.create(**seeded)
        deltas, finish = _stream(
            client, **{k: v for k, v in seeded.items() if k not in ("model", "messages")}
        )
    message = out.choices[0].message
    assert message.content  # random text of a tiny model holds no <think>: all content
    assert message.reasoning_content is None  # type: ignore[attr-defined]
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert _joined(deltas, "content") == message.content
    assert finish == "length"
