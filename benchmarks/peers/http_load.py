"""One HTTP load generator for every engine's OpenAI-compatible server: `asyncengine serve`,
llama.cpp's `llama-server` and `vllm serve`.

Each request is a streamed `/v1/completions` with a token-id prompt, greedy, EOS ignored, so
every request generates exactly `max_tokens` tokens. Per stream it records the time to the
first token (TTFT) and the inter-token latencies (ITL); per wave, output tokens over the wall
time. The summary has the shape of `runner._stream_stats`, so the report reads HTTP and
in-process runs alike.

The pipeline: bytes → `SSEParser` (events) → `StreamTally` (tokens and times of one stream) →
`summarize` (one wave). The first two are pure, tested on recorded streams.

How many tokens an event carries differs by server:
- asyncengine and vLLM, asked for `stream_options.continuous_usage_stats`, put a running
  `usage.completion_tokens` in every event; an event may carry several tokens.
- llama-server ignores `continuous_usage_stats`: one event per token, without usage, then a
  last event with an empty text, the finish reason and the usage, then `data: [DONE]`.
- With `include_usage`, asyncengine and vLLM end with a usage-only event (no choices).

Imports only the standard library and aiohttp (inside `run_load`), so it runs in any peer's
interpreter.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import percentile

# Requests run one after another at concurrency 1, as runner.py's async mode does: enough
# ITL samples for a p99 without making the one-stream wave the longest of the run.
C1_REQUESTS = 4


class LoadError(RuntimeError):
    """A request failed: a non-200 status, an error event, or fewer tokens than asked for."""


# ---- SSE framing -------------------------------------------------------------------------------


class SSEParser:
    """Server-sent events → decoded JSON objects, across arbitrary chunk boundaries.

    Events end at a blank line; an event's `data:` lines are joined with newlines and decoded
    as JSON. `data: [DONE]`, comment lines (starting with `:`) and other fields (`event:`,
    `id:`, `retry:`) yield nothing. Lines may end in LF or CRLF. An event not yet ended by a
    blank line stays buffered until a later `feed` completes it.
    """

    def __init__(self) -> None:
        self._pending = b""  # the start of a line whose end has not arrived
        self._data: list[bytes] = []  # the data lines of the event being read

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The events completed by `data`, in order."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        events: list[dict[str, Any]] = []
        for line in lines:
            # A CRLF's CR stays on the line when the LF arrives in the next chunk: strip it here,
            # once the line is whole.
            line = line.removesuffix(b"\r")
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif line.startswith(b":"):
                continue
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def _dispatch(self) -> dict[str, Any] | None:
        if not self._data:
            return None
        payload = b"\n".join(self._data)
        self._data = []
        if payload == b"[DONE]":
            return None
        event = json.loads(payload)
        if not isinstance(event, dict):
            raise LoadError(f"an SSE event that is not a JSON object: {payload[:200]!r}")
        return event


# ---- token accounting --------------------------------------------------------------------------


@dataclass(slots=True)
class StreamTally:
    """The tokens and arrival times of one streamed completion, fed its events in order.

    Counting rules (see the module docstring for which server does what):
    1. An event with choices and `usage.completion_tokens` moves the count to that total (it
       may carry several tokens, or none: llama-server's closing event repeats the total).
    2. Any other event with a choice adds one token (llama-server's one event per token).
    3. A usage-only event (no choices) sets the count to its total: the server's count wins
       over the per-event guess.
    The count never exceeds `max_tokens`.

    Times (seconds, `time.perf_counter()`): `ttft` from `submitted` to the first event that
    adds a token; an event adding k tokens `g` seconds after the previous one adds k values
    g/k to `itl`. Tokens that arrive with the first one add no ITL value.
    """

    max_tokens: int
    submitted: float
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    _last: float = 0.0  # when the last token arrived

    def add(self, event: dict[str, Any], now: float) -> int:
        """Account for `event`, which arrived at `now`; the tokens it added (negative when a
        usage total corrects an overcount)."""
        choices = event.get("choices")
        usage = event.get("usage")
        total = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(total, int):
            k = min(total, self.max_tokens) - self.tokens  # rules 1 and 3
            if not choices and k > 0:
                # Rule 3 corrects the total only: when these tokens arrived is unknown.
                self.tokens += k
                return k
        elif choices:
            k = 1 if self.tokens < self.max_tokens else 0  # rule 2
        else:
            return 0
        if k > 0:
            self._record_arrival(k, now)
        self.tokens += k
        return k

    def _record_arrival(self, k: int, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.submitted
        else:
            gap = (now - self._last) / k
            self.itl.extend([gap] * k)
        self._last = now


def summarize(tallies: Sequence[StreamTally], wall_seconds: float) -> dict[str, Any]:
    """One wave's numbers, in `runner._stream_stats`'s shape: `tok_s` (output tokens over
    `wall_seconds`), `tokens`, `wall_s`, `num_requests`, and `ttft_ms` / `itl_ms` as
    {"p50", "p99"} in milliseconds (each left out when it has no samples)."""
    tokens = sum(t.tokens for t in tallies)
    stats: dict[str, Any] = {
        "tok_s": tokens / wall_seconds,
        "tokens": tokens,
        "wall_s": wall_seconds,
        "num_requests": len(tallies),
    }
    ttft = [t.ttft * 1000 for t in tallies if t.ttft is not None]
    itl = [gap * 1000 for t in tallies for gap in t.itl]
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl)):
        if values:
            stats[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    return stats


# ---- the load generator ------------------------------------------------------------------------


def greedy_stream_body(max_tokens: int, model: str | None, **fields: Any) -> dict[str, Any]:
    """A streamed, greedy request with usage in every event: `fields` (its prompt or messages,
    and anything else) and those settings."""
    body: dict[str, Any] = {
        **fields,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if model is not None:
        body["model"] = model
    return body


def completion_body(
    prompt: Sequence[int], max_tokens: int, model: str | None = None
) -> dict[str, Any]:
    """The request every server gets: streamed, greedy, EOS ignored, usage in every event."""
    return greedy_stream_body(max_tokens, model, prompt=list(prompt), ignore_eos=True)


async def read_stream(
    response: Any, base_url: str, add: Callable[[dict[str, Any], float], object]
) -> None:
    """Each event of an aiohttp streamed `response` into `add(event, arrival time)`. Raises
    LoadError (with the response body) on a non-200 status and on an error event."""
    if response.status != 200:
        raise LoadError(f"HTTP {response.status} from {base_url}: {await response.text()}")
    parser = SSEParser()
    async for data in response.content.iter_any():
        now = time.perf_counter()  # one clock read per read: its events arrived together
        for event in parser.feed(data):
            if "error" in event:
                raise LoadError(f"error event from {base_url}: {event['error']}")
            add(event, now)


async def stream_one(
    session: Any, base_url: str, prompt: Sequence[int], max_tokens: int, model: str | None = None
) -> StreamTally:
    """One streamed completion on an aiohttp `session`: its tally.

    Raises LoadError (with the response body) on a non-200 status, on an error event, and when
    the stream ends with fewer than `max_tokens` tokens (EOS is ignored, so that is a failure).
    """
    body = completion_body(prompt, max_tokens, model)
    tally = StreamTally(max_tokens=max_tokens, submitted=time.perf_counter())
    async with session.post(base_url + "/v1/completions", json=body) as response:
        await read_stream(response, base_url, tally.add)
    if tally.tokens != max_tokens:
        raise LoadError(f"a stream from {base_url} ended with {tally.tokens}/{max_tokens} tokens")
    return tally


async def run_wave(
    session: Any,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    *,
    max_tokens: int,
    model: str | None = None,
) -> tuple[list[StreamTally], float]:
    """Every prompt, with at most `concurrency` requests in flight (each worker sends its next
    request when its last one ends); the tallies (in completion order) and the wall seconds."""
    queue = list(reversed(prompts))
    tallies: list[StreamTally] = []

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            tallies.append(await stream_one(session, base_url, prompt, max_tokens, model))

    start = time.perf_counter()
    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(prompts)))]
    try:
        await asyncio.gather(*workers)
    finally:
        # On a failure, stop the other streams before the session closes under them.
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return tallies, time.perf_counter() - start


async def run_load(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    *,
    max_tokens: int = 64,
    model: str | None = None,
    warmup: int = 2,
    warmup_prompts: Sequence[Sequence[int]] | None = None,
    request_timeout: float = 600.0,
) -> dict[str, Any]:
    """Drive the server at `base_url` (e.g. http://127.0.0.1:8000) with `prompts` at
    `concurrency` streams; the wave's summary (see `summarize`), plus `concurrency`.

    At concurrency 1 only the first C1_REQUESTS prompts run, one after another. First, `warmup`
    requests run untimed (two at a time): `warmup_prompts` if given, else the first prompts
    with their tokens reversed, which share no prefix with the timed ones, so neither the
    engine's prefix cache nor llama-server's per-slot prompt cache gives the timed wave a head
    start. `request_timeout` bounds the wait for any one read of a response (not the whole
    request). Raises LoadError as `stream_one` does. asyncio only (aiohttp).
    """
    import aiohttp

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    timed = list(prompts[:C1_REQUESTS] if concurrency == 1 else prompts)
    if warmup_prompts is None:
        warmup_prompts = [list(reversed(p)) for p in prompts[:warmup]]
    # A connection per request: llama-server (cpp-httplib) closes kept-alive connections under
    # aiohttp, which then fails the next request on a dead socket; the same for every engine.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup_prompts:
            await run_wave(session, base_url, warmup_prompts, 2, max_tokens=max_tokens, model=model)
        tallies, wall = await run_wave(
            session, base_url, timed, concurrency, max_tokens=max_tokens, model=model
        )
    return {**summarize(tallies, wall), "concurrency": concurrency}
