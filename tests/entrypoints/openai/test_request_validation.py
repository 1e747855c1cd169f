"""Every bad field of a generation request is refused before a response starts.

A real server on 127.0.0.1 (the module's `server`) gets request bodies in which hypothesis
has spoiled one to three fields (out of range, of the wrong type, or missing), for both
generation endpoints. Each must be a 4xx in OpenAI's error shape naming a spoiled field, the
same whether streamed or not: never a 500, never a 200 whose stream then carries the error.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_testing import API_KEY, ENGINE_KW, MODEL_NAME, RunningServer, parse_sse, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app

pytestmark = pytest.mark.timeout(300)

I64 = 2**63
I32 = 2**31
# Past 64 bits: msgspec decodes JSON integers of any size, so each field must check its own.
BIG = [2**64 + 1, 2**63, -(2**63) - 1, -(2**64) - 1, 10**30]
EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    # Module-scoped, as hypothesis needs: one client for every example.
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as http:
        yield http


# ---- what a spoiled field may hold -------------------------------------------------------------


def _not(*kinds: str) -> st.SearchStrategy[Any]:
    """JSON values of every kind but `kinds` ("int", "float", "str", "bool", "list", "dict";
    null is left out: it means "the default" for every optional field)."""
    values: dict[str, st.SearchStrategy[Any]] = {
        "int": st.integers(-5, 5),
        "float": st.sampled_from([0.5, -1.5, 1e300]),
        "str": st.sampled_from(["", "yes", "1"]),
        "bool": st.booleans(),
        "list": st.sampled_from([[], [1], ["a"]]),
        "dict": st.sampled_from([{}, {"a": 1}]),
    }
    return st.one_of(*(s for k, s in values.items() if k not in kinds))


def _ints(low: int, high: int) -> st.SearchStrategy[Any]:
    """Integers just outside [low, high] and far past it, or values that are not integers."""
    outside = st.integers(low - 3, low - 1) | st.integers(high + 1, high + 3) | st.sampled_from(BIG)
    return outside | _not("int")


def _floats(low: float, high: float, *, open_low: bool = False) -> st.SearchStrategy[Any]:
    """Numbers outside [low, high] (or (low, high]), or values that are not numbers."""
    outside = [low - 0.001, low - 1.0, -1e300, high + 0.001, high + 1.0, 1e300]
    return st.sampled_from(outside + [low] * open_low) | _not("int", "float")


BOOL = _not("bool")
SHARED: dict[str, st.SearchStrategy[Any]] = {
    "stream": BOOL,
    "model": st.sampled_from(["gpt-4", "", MODEL_NAME + "x"]) | _not("str"),
    "n": _ints(1, 256),
    "temperature": st.one_of(st.sampled_from([-0.001, -1.0, -1e300]), _not("int", "float")),
    "top_p": _floats(0.0, 1.0, open_low=True),
    "top_k": _ints(-1, I32 - 1),
    "min_p": _floats(0.0, 1.0),
    "seed": _ints(0, I64 - 1),
    "stop": st.sampled_from(["", [""], ["a", ""], [1], ["x"] * 65, ["x" * 8193]])
    | _not("str", "list"),
    "presence_penalty": _floats(-2.0, 2.0),
    "frequency_penalty": _floats(-2.0, 2.0),
    "repetition_penalty": _floats(0.0, 2.0, open_low=True),
    "min_tokens": st.one_of(st.integers(3, 100), _ints(0, I32 - 1)),  # more than max_tokens
    "stop_token_ids": st.one_of(
        st.sampled_from([[-1], [I32], [2**64 + 1], [0] * 1025, [1.5], ["1"]]), _not("list")
    ),
    "ignore_eos": BOOL,
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "priority": st.one_of(st.sampled_from(BIG), _not("int")),
    "logit_bias": st.sampled_from([{"1": 1.0}, {"5": -100}, {"a": "b"}]) | _not("dict"),
    "stream_options": st.sampled_from([{"include_usage": "yes"}, {"continuous_usage_stats": 1}])
    | _not("dict"),
    "user": _not("str"),
    "response_format": st.sampled_from(
        [
            {"type": "bogus"},
            {},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": "x"},
            {"type": "json_schema", "json_schema": {"schema": 5}},
            {"type": "json_schema", "json_schema": {"schema": "{not json"}},
        ]
    )
    | _not("dict"),
    "structured_outputs": st.sampled_from(
        [
            {},
            {"bogus": 1},
            {"choice": []},
            {"choice": [1]},
            {"regex": ""},
            {"json": 5},
            {"json_object": "yes"},
            {"regex": "a", "choice": ["b"]},
        ]
    )
    | _not("dict"),
}

COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **SHARED,
    "prompt": st.sampled_from(
        [[], [[]], [-1], [10**6], [2**64 + 1], ["a", 1], [["a"]], [[1], "a"], [0] * 600, [1.5]]
    )
    | _not("str", "list"),
    "max_tokens": st.one_of(st.integers(600, 2000), _ints(1, I32 - 1)),  # past max_model_len
    "logprobs": _ints(0, 20),
    "echo": BOOL,
    "best_of": st.integers(2, 5) | _not("int"),  # only best_of == n is served
    "suffix": st.sampled_from(["x", ""]) | _not("str"),
}

_MESSAGE = {"role": "user", "content": "hello"}
CHAT: dict[str, st.SearchStrategy[Any]] = {
    **SHARED,
    "messages": st.sampled_from(
        [
            [],
            [{"content": "x"}],
            [{"role": "wizard", "content": "x"}],
            [{"role": 5, "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"text": "x"}]}],
            [{"role": "user", "content": "x", "name": 5}],
            [{"role": "user", "content": "x", "tool_calls": "x"}],
            [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}],
            [{"role": "assistant", "content": "", "tool_calls": [5]}],
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 5}}]}],
            [{"role": "user", "content": "x", "tool_call_id": 5}],
            [_MESSAGE, 5],
            [{"role": "user", "content": "x " * 600}],
        ]
    )
    | _not("list"),
    "max_tokens": st.one_of(st.integers(600, 2000), _ints(1, I32 - 1)),
    "max_completion_tokens": st.one_of(st.integers(600, 2000), _ints(1, I32 - 1)),
    "logprobs": _not("bool"),
    "top_logprobs": _ints(0, 20),
    "tools": st.sampled_from(
        [
            [{"type": "function"}],
            [{"type": "x", "function": {"name": "f"}}],
            [{"type": "function", "function": {"name": ""}}],
            [{"type": "function", "function": {"name": 5}}],
            [{"type": "function", "function": {"name": "f", "parameters": 5}}],
            [{"type": "function", "function": "f"}],
            [5],
        ]
    )
    | _not("list"),
    "tool_choice": st.sampled_from(
        [
            "bogus",
            "Required",
            {"type": "function", "function": {"name": "nope"}},
            {"type": "function", "function": "f"},
            {"type": "function", "function": {"name": ["f"]}},
            {"type": "function"},
            {},
            5,
            ["auto"],
        ]
    ),
    "parallel_tool_calls": BOOL,
    "add_generation_prompt": BOOL,
    "chat_template_kwargs": _not("dict"),
}

# Fields a body may also carry, with values that are valid and that leave the others' checks
# as they are (no min_tokens, logprobs or echo: they are checked against each other).
VALID_SHARED: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([0.0, 0.7, 2.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "seed": st.integers(0, I64 - 1),
    "stop": st.sampled_from(["\n", ["x", "yz"]]),
    "priority": st.integers(-(2**63), I64 - 1),
    "user": st.just("someone"),
    "presence_penalty": st.just(0.5),
    "stream_options": st.just({"include_usage": True}),
}
VALID_CHAT = {
    **VALID_SHARED,
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "parallel_tool_calls": st.booleans(),
}
REQUIRED = ("prompt", "messages")


@st.composite
def spoiled_bodies(
    draw: st.DrawFn,
    base: dict[str, Any],
    valid: dict[str, st.SearchStrategy[Any]],
    spoilers: dict[str, st.SearchStrategy[Any]],
) -> tuple[dict[str, Any], set[str]]:
    """A valid body with one to three fields spoiled, and the spoiled fields' names. A
    required field may be left out instead."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=3, unique=True)):
        body[name] = draw(valid[name])
    names = st.lists(st.sampled_from(sorted(spoilers)), min_size=1, max_size=3, unique=True)
    spoiled = set(draw(names))
    for name in spoiled:
        if name in REQUIRED and draw(st.booleans()):
            del body[name]  # a required field, missing
        else:
            body[name] = draw(spoilers[name])
    return body, spoiled


def _names_a_spoiled_field(param: str | None, spoiled: set[str]) -> bool:
    # msgspec names the place inside a field: "messages[0].role", "stop[0]".
    return param is not None and any(
        param == name or param.startswith((f"{name}[", f"{name}.")) for name in spoiled
    )


def _refusal(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error a refused request gets; fails for anything else (a 200, a stream, a 5xx)."""
    response = http.post(path, json=body)
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json", response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code and error["message"], error
    return dict(error)


def _check_refused(http: httpx.Client, path: str, body: dict[str, Any], spoiled: set[str]) -> None:
    if "stream" in spoiled:  # a stream flag of the wrong type: sent as it is, once
        error = _refusal(http, path, body)
        assert _names_a_spoiled_field(error["param"], spoiled), (body, error)
        return
    plain = _refusal(http, path, {**body, "stream": False})
    assert _names_a_spoiled_field(plain["param"], spoiled), (body, plain)
    # Streamed, the same refusal, before any stream starts.
    assert _refusal(http, path, {**body, "stream": True}) == plain, body


def _serves_normally(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [_MESSAGE], "max_tokens": 2}),
    ):
        assert http.post(path, json=body).status_code == 200
        streamed = http.post(path, json={**body, "stream": True})
        assert streamed.status_code == 200
        assert "error" not in str(parse_sse(streamed.text)[:-1])


# ---- the property, for each endpoint ------------------------------------------------------------


@pytest.mark.timeout(600)
@EXAMPLES
@given(spoiled_bodies({"prompt": "hello", "max_tokens": 2}, VALID_SHARED, COMPLETION))
def test_every_bad_completion_field_is_refused_before_streaming(
    http: httpx.Client, server: RunningServer, case: tuple[dict[str, Any], set[str]]
) -> None:
    _check_refused(http, "/v1/completions", *case)
    assert not server.state.in_flight


@pytest.mark.timeout(600)
@EXAMPLES
@given(spoiled_bodies({"messages": [_MESSAGE], "max_tokens": 2}, VALID_CHAT, CHAT))
def test_every_bad_chat_field_is_refused_before_streaming(
    http: httpx.Client, server: RunningServer, case: tuple[dict[str, Any], set[str]]
) -> None:
    _check_refused(http, "/v1/chat/completions", *case)
    assert not server.state.in_flight


@pytest.mark.timeout(120)
def test_the_server_serves_normally_after_bad_requests(http: httpx.Client) -> None:
    _serves_normally(http)


# ---- regressions ---------------------------------------------------------------------------------

BODIES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [_MESSAGE], "max_tokens": 1},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("priority", [2**64 + 1, 2**63, -(2**63) - 1])
@pytest.mark.parametrize("stream", [True, False])
def test_priority_past_64_bits_is_a_400_before_any_stream(
    http: httpx.Client, path: str, priority: int, stream: bool
) -> None:
    # It was a 200, then an error event in the stream (after the chat's role chunk).
    response = http.post(path, json={**BODIES[path], "priority": priority, "stream": stream})
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == "priority" and "priority" in error["message"]


_ASSISTANT = {"role": "assistant", "content": ""}
# Found by the properties above: each was a 500, a 200, or named another field.
FOUND: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{**_ASSISTANT, "tool_calls": [{"function": "f"}]}]}, "messages[0].tool_calls"),
    ({"messages": [{**_ASSISTANT, "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
    ({"max_tokens": -1, "max_completion_tokens": 2}, "max_tokens"),
    ({"max_completion_tokens": 600}, "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fields", "param"), FOUND)
@pytest.mark.parametrize("stream", [True, False])
def test_chat_fields_found_by_the_property(
    http: httpx.Client, fields: dict[str, Any], param: str, stream: bool
) -> None:
    body = {"messages": [_MESSAGE], **fields, "stream": stream}
    assert _refusal(http, "/v1/chat/completions", body)["param"] == param


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("priority", [2**63 - 1, -(2**63)])
def test_priority_at_the_64_bit_bounds_is_served(
    http: httpx.Client, path: str, priority: int
) -> None:
    response = http.post(path, json={**BODIES[path], "priority": priority, "stream": True})
    assert response.status_code == 200, response.text
    assert "error" not in str(parse_sse(response.text)[:-1])


@pytest.mark.timeout(120)
def test_a_template_that_raises_on_a_request_is_a_400(chat_model: Path, tmp_path: Path) -> None:
    # Templates raise Python's errors too (a TypeError here, for the number it is given):
    # they were a 500, or with a stream, a 500 before it.
    model = tmp_path / "model"
    shutil.copytree(chat_model, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] ~ (m['name'] + 1) }}{% endfor %}"
    )
    engine = AsyncLLM.from_pretrained(model, core="thread", **ENGINE_KW)
    with (
        run_in_thread(build_app(engine, api_key=API_KEY)) as running,
        httpx.Client(base_url=running.url, headers=running.auth, timeout=60) as http,
    ):
        message = {**_MESSAGE, "name": "someone"}
        for stream in (False, True):
            body = {"messages": [message], "max_tokens": 1, "stream": stream}
            error = _refusal(http, "/v1/chat/completions", body)
            assert error["param"] == "messages" and "TypeError" in error["message"]


@pytest.mark.timeout(180)
def test_a_constraint_the_core_cannot_compile_is_a_400_before_any_stream(
    chat_model: Path,
) -> None:
    # A core process's first compile loads xgrammar (over a second here): the status line
    # went out after a second, and the refusal then broke the stream off.
    engine = AsyncLLM.from_pretrained(chat_model, core="process", **ENGINE_KW)
    with (
        run_in_thread(build_app(engine, api_key=API_KEY)) as running,
        httpx.Client(base_url=running.url, headers=running.auth, timeout=60) as http,
    ):
        for path, body in BODIES.items():
            body = {**body, "structured_outputs": {"regex": "("}, "stream": True}
            error = _refusal(http, path, body)
            assert error["param"] == "structured_outputs" and "regex" in error["message"]
        _serves_normally(http)
