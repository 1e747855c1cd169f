"""The OpenAI-compatible server, as clients see it: a real uvicorn server on 127.0.0.1 with a
tiny model, driven by the official `openai` client (sync and async) and by httpx.

One server for the module; after every test the engine is idle with its KV blocks free
(checked through /metrics, as an operator would).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from openai_testing import API_KEY, MAX_BODY, MODEL_NAME, RunningServer, parse_metrics, parse_sse

import asyncengine

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["hello world", "the engine is fast", "a cache block of the model", "async token"]
GREEDY: dict[str, Any] = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
LONG = 480  # tokens: long enough that a stream is still running when its client leaves

# The openai client stops reading its stream at `data: [DONE]` and leaves its inner async
# generators (its SSE decoder, httpx's byte iterators) unexhausted; asyncio closes them
# silently when they are collected, trio warns. Not the server's doing: ignored for them only.
OPENAI_ASYNCGEN_WARNINGS = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)


def metrics(server: RunningServer) -> dict[str, float]:
    response = httpx.get(server.url + "/metrics", headers=server.auth, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_metrics(response.text)


def wait_for_metrics(server: RunningServer, ok: Any, limit_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + limit_s
    while True:
        current = metrics(server)
        if ok(current):
            return current
        assert time.monotonic() < deadline, f"metrics never got there: {current}"
        time.sleep(0.01)


def is_idle(m: dict[str, float]) -> bool:
    return (
        m["asyncengine_num_requests_running"] == 0
        and m["asyncengine_num_requests_waiting"] == 0
        and m["asyncengine_kv_cache_usage_perc"] == 0.0
    )


@pytest.fixture(autouse=True)
def _idle_after(server: RunningServer) -> Iterator[None]:
    yield
    wait_for_metrics(server, is_idle)
    assert not server.state.in_flight


@pytest.fixture
async def aclient(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as http:
        yield http


# ---- endpoints -------------------------------------------------------------------------------


def test_models(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert card.model_extra is not None and card.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_equals_its_stream(client: openai.OpenAI, server: RunningServer) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **GREEDY)
    [choice] = full.choices
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = len(server.state.engine.tokenizer.encode(PROMPTS[1]))
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 12)
    assert full.usage.total_tokens == prompt_tokens + 12

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert len({c.id for c in chunks}) == 1 and len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_equal_text_prompts(client: openai.OpenAI, server: RunningServer) -> None:
    ids = server.state.engine.tokenizer.encode(PROMPTS[2])
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_batch_of_prompts_with_n(client: openai.OpenAI) -> None:
    singles = [
        client.completions.create(model=MODEL_NAME, prompt=p, **GREEDY).choices[0].text
        for p in PROMPTS[:2]
    ]
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, **GREEDY)
    # Choice i * n + j is sequence j of prompt i; greedy sequences of a prompt are equal.
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert batch.usage is not None and batch.usage.completion_tokens == 4 * 12


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    full = text.choices[0].text
    stop = full.split()[2]  # a word from the middle
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    [choice] = cut.choices
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[3], temperature=1.0, top_p=0.9, seed=seed,
            max_tokens=16, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    assert sample(11) == sample(11)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], logprobs=2, **dict(GREEDY, max_tokens=5)
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0.0
        assert token in top and 1 <= len(top) <= 3  # the top 2, and the sampled token
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset)

    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text


def test_chat_completion(client: openai.OpenAI, server: RunningServer) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "the model is fast"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    [choice] = out.choices
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    tokenizer = server.state.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": "hello"}], tokenize=True
    )
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(rendered), 6)


@OPENAI_ASYNCGEN_WARNINGS
async def test_async_chat_stream_with_n_and_logprobs(aclient: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello world"}],
        n=2, temperature=0.8, seed=7, max_tokens=8, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    stream = await aclient.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    content: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, str] = {}
    finish: dict[int, str] = {}
    num_logprobs = {0: 0, 1: 0}
    usage = None
    async with stream:
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.role is not None:
                    assert c.index not in roles and content[c.index] == ""  # role comes first
                    roles[c.index] = c.delta.role
                content[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
                if c.logprobs is not None and c.logprobs.content:
                    for entry in c.logprobs.content:
                        num_logprobs[c.index] += 1
                        tops = [t.logprob for t in entry.top_logprobs]
                        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
                        assert entry.bytes == list(entry.token.encode())
    assert roles == {0: "assistant", 1: "assistant"}
    assert finish == {0: "length", 1: "length"}
    assert num_logprobs == {0: 8, 1: 8}
    assert usage is not None and usage.completion_tokens == 16

    # The same seeded request, not streamed: the same texts.
    full = await aclient.chat.completions.create(**kwargs)
    assert {c.index: c.message.content for c in full.choices} == content
    assert all(c.logprobs is not None and len(c.logprobs.content or []) == 8 for c in full.choices)


@OPENAI_ASYNCGEN_WARNINGS
async def test_async_completion_stream(aclient: openai.AsyncOpenAI) -> None:
    full = await aclient.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    stream = await aclient.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **GREEDY
    )
    async with stream:
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == full.choices[0].text


def test_health_version_and_metrics(http: httpx.Client, server: RunningServer) -> None:
    health = httpx.get(server.url + "/health", timeout=30)  # no API key needed
    assert health.status_code == 200
    assert http.get("/version").json() == {"version": asyncengine.__version__}
    m = metrics(server)
    for name in (
        "asyncengine_num_requests_running", "asyncengine_num_requests_waiting",
        "asyncengine_kv_cache_usage_perc", "asyncengine_prefix_cache_hit_rate",
        "asyncengine_prompt_tokens_total", "asyncengine_generation_tokens_total",
        "asyncengine_time_to_first_token_seconds_count",
        "asyncengine_inter_token_latency_seconds_count",
        "asyncengine_e2e_request_latency_seconds_count",
        'asyncengine_time_to_first_token_seconds_bucket{le="+Inf"}',
    ):  # fmt: skip
        assert name in m, name
    assert m["asyncengine_kv_cache_blocks"] == 512


def test_metrics_count_tokens_and_latencies(client: openai.OpenAI, server: RunningServer) -> None:
    prompt = "the model of the world is a block cache " * 5  # several full KV blocks
    before = metrics(server)
    client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)  # a prefix-cache hit
    after = metrics(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    num_prompt = len(server.state.engine.tokenizer.encode(prompt))
    assert delta("asyncengine_prompt_tokens_total") == 2 * num_prompt
    assert delta("asyncengine_generation_tokens_total") == 2 * 12
    assert delta('asyncengine_request_success_total{finished_reason="length"}') == 2
    assert delta("asyncengine_time_to_first_token_seconds_count") == 2
    assert delta("asyncengine_e2e_request_latency_seconds_count") == 2
    assert 0 < delta("asyncengine_inter_token_latency_seconds_count") <= 2 * 11
    assert delta("asyncengine_prefix_cache_hits_total") > 0
    assert 0 < after["asyncengine_prefix_cache_hit_rate"] <= 1
    # Histogram buckets are cumulative and end at the count.
    name = "asyncengine_e2e_request_latency_seconds"
    buckets = [v for k, v in after.items() if k.startswith(name + "_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after[name + "_count"]


# ---- errors ----------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),  # longer than max_model_len
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    # Integers past 64 bits were a 500 (OverflowError) that leaked the request's table entry.
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64 + 1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64 + 1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 10**6, "max_tokens": 1}, 400, "n"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
        + b"[" * 30_000 + b"]" * 30_000 + b"}}",
        400,
        None,
    ),  # past msgspec's recursion limit (3.12's C limit lets 5,000 by; the body limit is 64 KiB)
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "m"},
     404, "model"),
]  # fmt: skip


def _assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"].endswith("Error")


def _body_id(value: object) -> str | None:
    """A short test id for a long body (pytest would spell it out in full)."""
    text = repr(value)
    return f"{text[:60]}...({len(text)} chars)" if len(text) > 80 else None


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS, ids=_body_id)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_name_the_field(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None, stream: bool
) -> None:
    # Streamed or not, a bad request is refused before the response starts.
    if stream and isinstance(body, dict) and "stream" not in body:
        body = dict(body, stream=True)
    if isinstance(body, bytes):  # bodies that no JSON encoder would write
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    _assert_error(response, status, param)
    assert http.get("/v1/models").status_code == 200  # the connection is still usable


def test_body_that_is_not_json(http: httpx.Client) -> None:
    json_type = {"content-type": "application/json"}
    response = http.post("/v1/completions", content=b'{"prompt": "hi"', headers=json_type)
    _assert_error(response, 400, None)
    assert "JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_refused(http: httpx.Client, content_type: str | None) -> None:
    # What a browser page can send to any host without a CORS preflight: never executed.
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"prompt": "hi", "max_tokens": 2}'
    response = http.post("/v1/completions", content=body, headers=headers)
    _assert_error(response, 415, None)


def test_openai_client_raises_by_status(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.param == "model"
    with (
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0) as intruder,
        pytest.raises(openai.AuthenticationError),
    ):
        intruder.models.list()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL_NAME}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/no/such/path"),
    ],
)
def test_api_key_is_required_everywhere_but_health(
    server: RunningServer, method: str, path: str
) -> None:
    body = {"prompt": "hi"} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.request(method, server.url + path, json=body, headers=headers)
        _assert_error(response, 401, None)
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health").status_code == 200


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "a " * MAX_BODY}).encode()
    json_type = {"content-type": "application/json"}
    _assert_error(http.post("/v1/completions", content=big, headers=json_type), 413, None)

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    response = http.post("/v1/chat/completions", content=chunked(), headers=json_type)
    _assert_error(response, 413, None)


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    _assert_error(http.get("/v1/nothing"), 404, None)
    _assert_error(http.get("/v1/completions"), 405, None)


# ---- disconnects -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_the_request(server: RunningServer, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": LONG, "ignore_eos": True, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = PROMPTS[0]
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    before = metrics(server)
    with (
        httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving closes the connection mid-stream
    after = wait_for_metrics(server, is_idle)
    aborted = 'asyncengine_request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 1
    generated = after["asyncengine_generation_tokens_total"]
    assert generated - before["asyncengine_generation_tokens_total"] < LONG


def test_disconnect_while_waiting_for_a_full_completion(server: RunningServer) -> None:
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": LONG, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    before = metrics(server)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        wait_for_metrics(server, lambda m: m["asyncengine_num_requests_running"] >= 1)
    after = wait_for_metrics(server, is_idle)
    aborted = 'asyncengine_request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 1


# ---- load ------------------------------------------------------------------------------------


async def test_64_concurrent_streams_are_complete_and_well_formed(server: RunningServer) -> None:
    params: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    expected: list[str] = []
    results: dict[int, str] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": PROMPTS[i % 4], "stream": True, **params}
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            results[i] = (await response.aread()).decode()

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.auth, timeout=120, limits=limits
    ) as client:
        for p in PROMPTS:  # one at a time: the texts each stream must reproduce
            response = await client.post("/v1/completions", json={"prompt": p, **params})
            expected.append(response.json()["choices"][0]["text"])
        with anyio.fail_after(100):
            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, client, i)

    assert len(results) == 64
    for i, raw in results.items():
        events = parse_sse(raw)
        chunks, usage = events[:-2], events[-2]
        assert len({c["id"] for c in events[:-1]}) == 1
        assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected[i % 4]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons[-1] == "length" and reasons.count("length") == 1
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
