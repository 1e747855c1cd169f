"""The aiohttp example app (docs/examples/aiohttp_app.py) under aiohttp's test client: the
engine owned by the app's cleanup_ctx, generations streamed as SSE, errors, disconnects."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from integration_helpers import ENGINE_KW, load_example

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.integrations.aiohttp import ENGINE_KEY, stream_generation

pytestmark = pytest.mark.timeout(120)

example = load_example("aiohttp_app")


class _StreamSpy:
    """Stands in for the engine in a handler: records whether the stream it handed out was
    closed before its request finished (what a disconnect must do)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.closed_unfinished = anyio.Event()

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        finished = False
        try:
            async with aclosing(self.engine.generate(*args, **kwargs)) as stream:
                async for output in stream:
                    finished = output.finished
                    yield output
        finally:
            if not finished:
                self.closed_unfinished.set()


@pytest.fixture
async def client(tiny_llama: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = example.make_app(str(tiny_llama), **ENGINE_KW)

    async def long(request: web.Request) -> web.StreamResponse:
        spy = request.app[SPY]
        params = SamplingParams(max_tokens=480, ignore_eos=True)
        return await stream_generation(request, spy, "hello world", params)  # type: ignore[arg-type]

    async def add_spy(app: web.Application) -> AsyncIterator[None]:
        app[SPY] = _StreamSpy(app[ENGINE_KEY])
        yield

    app.cleanup_ctx.append(add_spy)  # after the engine's context, so the engine exists
    app.router.add_post("/long", long)
    async with TestClient(TestServer(app)) as client:
        yield client
    assert not app[ENGINE_KEY].is_running  # the cleanup context stopped the engine


SPY = web.AppKey("spy", _StreamSpy)


def _events(raw: str) -> list[Any]:
    assert raw.endswith("data: [DONE]\n\n")
    blocks = raw[:-2].split("\n\n")
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[6:]) for b in blocks[:-1]]


async def test_streams_a_generation(client: TestClient[web.Request, web.Application]) -> None:
    engine = client.app[ENGINE_KEY]
    params = SamplingParams(max_tokens=8, temperature=0)
    reference = [out async for out in engine.generate("hello world", params)][-1].outputs[0]

    response = await client.post(
        "/generate", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0}
    )
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    events = _events(await response.text())
    assert "".join(e["text"] for e in events) == reference.text
    assert [t for e in events for t in e["token_ids"]] == reference.token_ids
    assert events[-1]["finish_reason"] == reference.finish_reason
    assert all(e["finish_reason"] is None for e in events[:-1])


async def test_bad_requests(client: TestClient[web.Request, web.Application]) -> None:
    response = await client.post("/generate", json={"prompt": "hi", "temperature": -1})
    assert response.status == 400 and "temperature" in await response.text()
    response = await client.post("/generate", json={"max_tokens": 3})
    assert response.status == 400
    # Refused by the engine (longer than max_model_len): a JSON 400 before any event.
    response = await client.post("/generate", json={"prompt": "hello " * 600})
    assert response.status == 400
    assert "max_model_len" in (await response.json())["error"]["message"]
    stats = await client.app[ENGINE_KEY].get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


async def test_disconnect_aborts_the_request(
    client: TestClient[web.Request, web.Application],
) -> None:
    response = await client.post("/long")
    assert response.status == 200
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()  # the client goes away mid-stream
    engine, spy = client.app[ENGINE_KEY], client.app[SPY]
    with anyio.fail_after(10):
        await spy.closed_unfinished.wait()
        while True:
            stats = await engine.get_stats()
            if stats.num_running_reqs == 0:
                break
            await anyio.sleep(0.01)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
