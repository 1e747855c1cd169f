"""The HTTP load generator (SSE framing, per-stream token accounting, summaries) and the server
launchers, against recorded streams, a fake server and a real `asyncengine serve`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.http_load import (
    C1_REQUESTS,
    LoadError,
    SSEParser,
    StreamTally,
    run_load,
    summarize,
)
from benchmarks.peers.servers import (
    ServerError,
    asyncengine_command,
    free_port,
    running_server,
    vllm_command,
)
from benchmarks.workload import make_workload, model_vocab

# `asyncengine serve` (tiny model), max_tokens 5: a first event of 3 tokens, then one each,
# the finish reason with the last token, then a usage-only event.
ASYNCENGINE_STREAM = (
    b'data: {"id":"cmpl-1d3b","object":"text_completion","created":1795579267,"model":"tiny",'
    b'"choices":[{"index":0,"text":" w43 w39 w212","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}'
    b"\n\n"
    b'data: {"id":"cmpl-1d3b","object":"text_completion","created":1795579267,"model":"tiny",'
    b'"choices":[{"index":0,"text":" w151","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":4,"total_tokens":8}}'
    b"\n\n"
    b'data: {"id":"cmpl-1d3b","object":"text_completion","created":1795579267,"model":"tiny",'
    b'"choices":[{"index":0,"text":" w5","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":5,"total_tokens":9}}'
    b"\n\n"
    b'data: {"id":"cmpl-1d3b","object":"text_completion","created":1795579267,"model":"tiny",'
    b'"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":5,"total_tokens":9}}\n\n'
    b"data: [DONE]\n\n"
)

# llama.cpp's llama-server (b1-0c1e570, SmolLM2 Q4_1 GGUF; model path and timings shortened),
# max_tokens 5, continuous_usage_stats asked for and ignored: an event per token without usage,
# then an empty text with the finish reason and the usage.
_LLAMA_TAIL = (
    b'"created":1795579083,"model":"smollm2.gguf","system_fingerprint":"b1-0c1e570",'
    b'"object":"text_completion","id":"chatcmpl-rwfi"}\n\n'
)
LLAMA_SERVER_STREAM = (
    b'data: {"choices":[{"text":"is","index":0,"logprobs":null,"finish_reason":null}],'
    + _LLAMA_TAIL
    + b'data: {"choices":[{"text":".","index":0,"logprobs":null,"finish_reason":null}],'
    + _LLAMA_TAIL
    + b'data: {"choices":[{"text":"\\n","index":0,"logprobs":null,"finish_reason":null}],'
    + _LLAMA_TAIL
    + b'data: {"choices":[{"text":"\\n","index":0,"logprobs":null,"finish_reason":null}],'
    + _LLAMA_TAIL
    + b'data: {"choices":[{"text":"The","index":0,"logprobs":null,"finish_reason":null}],'
    + _LLAMA_TAIL
    + b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],'
    b'"created":1795579083,"model":"smollm2.gguf","system_fingerprint":"b1-0c1e570",'
    b'"object":"text_completion","usage":{"completion_tokens":5,"prompt_tokens":6,'
    b'"total_tokens":11,"prompt_tokens_details":{"cached_tokens":5}},"id":"chatcmpl-rwfi",'
    b'"timings":{"cache_n":5,"prompt_n":1,"predicted_n":5,"predicted_ms":58.679}}\n\n'
    b"data: [DONE]\n\n"
)

# What other servers may send: CRLF line ends, comments (keep-alives), a field other than
# data, an event split over two data lines, UTF-8 text, `data:` without its space.
MIXED_STREAM = (
    b": keep-alive\r\n\r\n"
    b'event: completion\r\ndata: {"choices":[{"text":"\xc3\xa9\xe2\x82\xac"}]}\r\n\r\n'
    b'data: {"choices":\r\ndata: [{"text":"x"}]}\r\n\r\n'
    b'data:{"choices":[],"usage":{"completion_tokens":2}}\n\n'
    b"data: [DONE]\r\n\r\n"
)
MIXED_EVENTS: list[dict[str, Any]] = [
    {"choices": [{"text": "é€"}]},
    {"choices": [{"text": "x"}]},
    {"choices": [], "usage": {"completion_tokens": 2}},
]


def _llama_events(n: int, *, final_usage: bool = True) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"choices": [{"text": "t"}]} for _ in range(n)]
    if final_usage:
        events.append(
            {
                "choices": [{"text": "", "finish_reason": "length"}],
                "usage": {"completion_tokens": n},
            }
        )
    return events


# ---- SSE framing -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("raw", "num_events"),
    [(ASYNCENGINE_STREAM, 4), (LLAMA_SERVER_STREAM, 6), (MIXED_STREAM, 3)],
    ids=["asyncengine", "llama-server", "mixed"],
)
def test_sse_parser_gives_the_same_events_at_every_split_point(raw: bytes, num_events: int) -> None:
    whole = SSEParser().feed(raw)
    assert len(whole) == num_events
    for i in range(len(raw) + 1):
        parser = SSEParser()
        assert parser.feed(raw[:i]) + parser.feed(raw[i:]) == whole, f"split at {i}"
    parser = SSEParser()
    assert [e for i in range(len(raw)) for e in parser.feed(raw[i : i + 1])] == whole


@pytest.mark.timeout(10)
def test_sse_parser_framing_rules() -> None:
    assert SSEParser().feed(MIXED_STREAM) == MIXED_EVENTS
    parser = SSEParser()
    # An event is given only once the blank line that ends it has arrived.
    assert parser.feed(b'data: {"a": 1}\n') == []
    assert parser.feed(b"\r") == []
    assert parser.feed(b"\n") == [{"a": 1}]
    assert parser.feed(b"data: [DONE]\n\n: bye\n\n") == []
    with pytest.raises(LoadError, match="not a JSON object"):
        SSEParser().feed(b"data: [1, 2]\n\n")


# ---- token accounting --------------------------------------------------------------------------


def _feed(tally: StreamTally, events: list[dict[str, Any]], times: list[float]) -> StreamTally:
    for event, now in zip(events, times, strict=True):
        tally.add(event, now)
    return tally


@pytest.mark.timeout(10)
def test_asyncengine_stream_counts_usage_per_event() -> None:
    events = SSEParser().feed(ASYNCENGINE_STREAM)
    tally = _feed(StreamTally(max_tokens=5, submitted=10.0), events, [10.5, 10.6, 10.8, 10.8])
    assert tally.tokens == 5
    assert tally.ttft == pytest.approx(0.5)
    # The first event's three tokens add no ITL; then two one-token events.
    assert tally.itl == pytest.approx([0.1, 0.2])


@pytest.mark.timeout(10)
def test_a_multi_token_event_spreads_its_gap_over_its_tokens() -> None:
    events = [
        {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}},
        {"choices": [{"text": "bcd"}], "usage": {"completion_tokens": 4}},
        {"choices": [{"text": ""}], "usage": {"completion_tokens": 4}},  # no new token
        {"choices": [{"text": "e"}], "usage": {"completion_tokens": 5}},
    ]
    tally = _feed(StreamTally(max_tokens=8, submitted=0.0), events, [0.2, 0.5, 0.6, 0.7])
    assert tally.tokens == 5
    assert tally.ttft == pytest.approx(0.2)
    assert tally.itl == pytest.approx([0.1, 0.1, 0.1, 0.2])


@pytest.mark.timeout(10)
def test_llama_server_stream_counts_one_token_per_event() -> None:
    events = SSEParser().feed(LLAMA_SERVER_STREAM)
    times = [1.1, 1.2, 1.3, 1.4, 1.5, 1.5]
    tally = _feed(StreamTally(max_tokens=5, submitted=1.0), events, times)
    assert tally.tokens == 5
    assert tally.ttft == pytest.approx(0.1)
    assert tally.itl == pytest.approx([0.1] * 4)
    # The closing event (choices and usage) repeats the total: with a larger max_tokens too.
    tally = _feed(StreamTally(max_tokens=64, submitted=1.0), events, times)
    assert tally.tokens == 5


@pytest.mark.timeout(10)
def test_a_usage_only_event_corrects_the_total() -> None:
    # Overcount: a closing event with a choice but no usage looks like a sixth token.
    events = [*_llama_events(5, final_usage=False), {"choices": [{"finish_reason": "length"}]}]
    tally = _feed(StreamTally(max_tokens=8, submitted=0.0), events, [1, 2, 3, 4, 5, 6])
    assert tally.tokens == 6
    assert tally.add({"choices": [], "usage": {"completion_tokens": 5}}, 7) == -1
    assert tally.tokens == 5
    # Undercount: the total rises, and the times stay those of the tokens seen.
    tally = _feed(
        StreamTally(max_tokens=8, submitted=0.0), _llama_events(3, final_usage=False), [1, 2, 3]
    )
    assert tally.add({"choices": [], "usage": {"completion_tokens": 5}}, 9) == 2
    assert (tally.tokens, tally.ttft, tally.itl) == (5, 1, [1, 1])


@pytest.mark.timeout(10)
def test_never_more_than_max_tokens() -> None:
    tally = _feed(
        StreamTally(max_tokens=4, submitted=0.0),
        _llama_events(10, final_usage=False),
        list(range(1, 11)),
    )
    assert (tally.tokens, len(tally.itl)) == (4, 3)
    usage = [{"choices": [{"text": "x"}], "usage": {"completion_tokens": 9}}]
    tally = _feed(StreamTally(max_tokens=4, submitted=0.0), usage, [1.0])
    assert tally.tokens == 4
    tally.add({"choices": [], "usage": {"completion_tokens": 9}}, 2.0)
    assert tally.tokens == 4


@pytest.mark.timeout(10)
def test_events_without_tokens_count_nothing() -> None:
    tally = StreamTally(max_tokens=4, submitted=0.0)
    assert tally.add({"id": "x", "object": "text_completion"}, 1.0) == 0
    assert tally.add({"choices": [], "usage": None}, 1.0) == 0
    assert (tally.tokens, tally.ttft) == (0, None)


# ---- summaries ---------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_summarize_percentiles_and_throughput() -> None:
    a = StreamTally(max_tokens=3, submitted=0.0, tokens=3, ttft=0.1, itl=[0.01, 0.02])
    b = StreamTally(max_tokens=3, submitted=0.0, tokens=3, ttft=0.3, itl=[0.03, 0.04])
    stats = summarize([a, b], wall_seconds=2.0)
    assert stats["tok_s"] == pytest.approx(3.0)
    assert (stats["tokens"], stats["num_requests"], stats["wall_s"]) == (6, 2, 2.0)
    # numpy's linear interpolation: p99 of [100, 300] is 100 + 0.99 * 200.
    assert stats["ttft_ms"] == pytest.approx({"p50": 200.0, "p99": 298.0})
    assert stats["itl_ms"] == pytest.approx({"p50": 25.0, "p99": 39.7})


@pytest.mark.timeout(10)
def test_summarize_leaves_out_latencies_without_samples() -> None:
    one_token = StreamTally(max_tokens=1, submitted=0.0, tokens=1, ttft=0.05)
    stats = summarize([one_token], wall_seconds=0.5)
    assert stats["tok_s"] == pytest.approx(2.0)
    assert stats["ttft_ms"] == pytest.approx({"p50": 50.0, "p99": 50.0})
    assert "itl_ms" not in stats


# ---- run_load against a fake llama-server ------------------------------------------------------


class FakeServer:
    """An aiohttp server that replays LLAMA_SERVER_STREAM in uneven chunks (or answers
    `status` with a JSON error), recording the request bodies."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        self.bodies.append(await request.json())
        if self.status != 200:
            return web.json_response({"error": {"message": "no such model"}}, status=self.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(LLAMA_SERVER_STREAM), 97):
            await response.write(LLAMA_SERVER_STREAM[start : start + 97])
            await asyncio.sleep(0.001)
        return response


@contextlib.asynccontextmanager
async def _serve_fake(fake: FakeServer) -> AsyncIterator[str]:
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiohttp runs on asyncio only
async def test_run_load_counts_a_llama_server_stream(anyio_backend: str) -> None:
    fake = FakeServer()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    async with _serve_fake(fake) as url:
        one = await run_load(url, prompts, 1, max_tokens=5, model="m", warmup=2)
        three = await run_load(url, prompts, 3, max_tokens=5, warmup=0)
    assert (one["num_requests"], one["tokens"], one["concurrency"]) == (3, 15, 1)
    assert (three["num_requests"], three["tokens"]) == (3, 15)
    assert one["ttft_ms"]["p50"] > 0 and one["itl_ms"]["p99"] >= one["itl_ms"]["p50"]
    # Two warm-up requests on the prompts reversed, then the timed ones; the body as documented.
    assert [b["prompt"] for b in fake.bodies[:2]] == [[3, 2, 1], [6, 5, 4]]
    assert fake.bodies[2] == {
        "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "model": "m",
    }  # fmt: skip
    assert "model" not in fake.bodies[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_load_fails_loudly(anyio_backend: str) -> None:
    async with _serve_fake(FakeServer(status=404)) as url:
        with pytest.raises(LoadError, match=r"HTTP 404.*no such model"):
            await run_load(url, [[1, 2]], 1, max_tokens=5, warmup=0)
    async with _serve_fake(FakeServer()) as url:
        # The stream holds 5 tokens: a request for 8 that ends at 5 is a failure, not a result.
        with pytest.raises(LoadError, match="5/8 tokens"):
            await run_load(url, [[1, 2]], 1, max_tokens=8, warmup=0)


# ---- server launchers --------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no such model: boom'); sys.exit(3)"]
    with (
        pytest.raises(ServerError, match=r"(?s)status 3 before it was ready.*no such model: boom"),
        running_server(command, f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "s.log"),
    ):
        pytest.fail("never ready")


@pytest.mark.timeout(60)
def test_a_server_never_ready_is_killed_with_its_children(tmp_path: Path) -> None:
    # Ignores SIGTERM, as a hung server would, and leaves a child behind.
    pids = tmp_path / "pids"
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "print('loading', flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with (
        # 10 s: a loaded machine can take seconds to start the two interpreters
        pytest.raises(ServerError, match=r"(?s)not ready in 10 s.*loading"),
        running_server(
            [sys.executable, "-c", code],
            f"http://127.0.0.1:{free_port()}",
            log_path=tmp_path / "s.log",
            ready_timeout=10,
            stop_timeout=1,
        ),
    ):
        pytest.fail("never ready")
    assert time.monotonic() - start < 30
    assert all(_gone(int(pid)) for pid in pids.read_text().split())


@pytest.mark.timeout(30)
def test_a_taken_port_is_refused_before_starting(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        url = f"http://127.0.0.1:{taken.getsockname()[1]}"
        marker = tmp_path / "started"
        command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        with pytest.raises(ServerError, match="already listens"), running_server(command, url):
            pytest.fail("unreachable")
    assert not marker.exists()


@pytest.mark.timeout(10)
def test_command_builders() -> None:
    command = asyncengine_command("/m", 8123, served_model_name="b", python="/py")
    assert command == [
        "/py", "-m", "asyncengine.entrypoints.cli", "serve", "/m", "--host", "127.0.0.1",
        "--port", "8123", "--dtype", "bfloat16", "--no-access-log", "--served-model-name", "b",
    ]  # fmt: skip
    command = vllm_command("/m", 8124, served_model_name="b", python="/vpy", extra_args=["-x"])
    assert command[:5] == ["/vpy", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert command[command.index("--port") + 1] == "8124"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[-1] == "-x"


# ---- end to end: a real `asyncengine serve` ----------------------------------------------------


@pytest.mark.timeout(240)
def test_run_load_against_asyncengine_serve(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("llama")
    vocab_size, specials = model_vocab(model)
    prompts = make_workload(
        vocab_size, specials, num_requests=8, min_prompt_len=4, max_prompt_len=24, output_len=6
    ).prompts
    port = free_port()
    command = asyncengine_command(
        model,
        port,
        served_model_name="tiny",
        dtype="float32",
        extra_args=["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "256"],
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base_url = f"http://127.0.0.1:{port}"
    with running_server(command, base_url, env=env, log_path=tmp_path / "serve.log") as server:
        assert server.ready_s > 0
        one = asyncio.run(run_load(base_url, prompts, 1, max_tokens=6, model="tiny"))
        four = asyncio.run(run_load(base_url, prompts, 4, max_tokens=6, model="tiny"))
        with pytest.raises(LoadError, match="HTTP 404"):
            asyncio.run(run_load(base_url, prompts, 1, max_tokens=6, model="other", warmup=0))
        members = [server.pid, *(c.pid for c in psutil.Process(server.pid).children(True))]
    # Every request streamed exactly max_tokens (run_load raises otherwise), and the summary
    # accounts for all of them.
    assert (one["num_requests"], one["tokens"]) == (C1_REQUESTS, C1_REQUESTS * 6)
    assert (four["num_requests"], four["tokens"]) == (8, 8 * 6)
    for stats in (one, four):
        assert stats["tok_s"] == pytest.approx(stats["tokens"] / stats["wall_s"])
        assert 0 < stats["ttft_ms"]["p50"] <= stats["ttft_ms"]["p99"]
        assert 0 <= stats["itl_ms"]["p50"] <= stats["itl_ms"]["p99"]
    # The server and its engine core are gone.
    assert len(members) >= 2
    assert all(_gone(pid) for pid in members)
