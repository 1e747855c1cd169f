"""`build_app` in process (httpx's ASGI transport, no socket): arguments, the engine's life
cycle in the app's lifespan, and 503 while the engine is not running."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from openai_testing import ENGINE_KW, parse_metrics, parse_sse, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(120)


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


async def test_engine_not_running_gives_503(chat_model: Path) -> None:
    # Built, never started (no lifespan runs under the ASGI transport): nothing is loaded.
    app = build_app(chat_model, core="thread", **ENGINE_KW)
    async with _client(app) as client:
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["type"] == "ServiceUnavailableError"
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == 503
        # The rest still answers; /metrics without the engine's gauges.
        # The folder's name: its path is not shown to clients.
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == chat_model.name
        metrics = parse_metrics((await client.get("/metrics")).text)
        assert "asyncengine_prompt_tokens_total" in metrics
        assert "asyncengine_num_requests_running" not in metrics


@pytest.mark.parametrize("served_model_name", [None, "tiny-served"])
async def test_models_never_show_the_model_folder(
    chat_model: Path, served_model_name: str | None
) -> None:
    # `serve --help` and docs/server.md promise it: `root` once showed the folder's path.
    app = build_app(chat_model, served_model_name=served_model_name, core="thread", **ENGINE_KW)
    name = served_model_name or chat_model.name
    folders = [str(chat_model.parent), str((await anyio.Path(chat_model).resolve()).parent)]
    async with _client(app) as client:
        listing = await client.get("/v1/models")
        card = await client.get(f"/v1/models/{name}")
    for response in (listing, card):
        assert response.status_code == 200
        assert not [folder for folder in folders if folder in response.text]
    assert listing.json()["data"] == [card.json()]
    assert card.json()["id"] == card.json()["root"] == name


def test_build_app_checks_its_arguments(chat_model: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_app(chat_model, device="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        build_app(chat_model, device="cpu", max_request_body_bytes=0)
    engine = AsyncLLM.from_pretrained(chat_model, device="cpu")
    with pytest.raises(TypeError, match="engine options"):
        build_app(engine, dtype="float32")


async def test_a_running_engine_is_left_to_its_owner(chat_model: Path) -> None:
    async with AsyncLLM.from_pretrained(chat_model, core="thread", **ENGINE_KW) as engine:
        app = build_app(engine, served_model_name="mine")
        async with app.router.lifespan_context(app), _client(app) as client:
            assert (await client.get("/health")).status_code == 200
            response = await client.post(
                "/v1/completions", json={"model": "mine", "prompt": "hello", "max_tokens": 3}
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] >= 1
        # The app's lifespan is over; the engine still belongs to this block.
        assert engine.is_running
        await engine.check_health()


def test_shutdown_aborts_the_streams_still_running(chat_model: Path) -> None:
    engine = AsyncLLM.from_pretrained(chat_model, core="thread", **ENGINE_KW)
    body = {"prompt": "hello", "n": 4, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with (
        run_in_thread(build_app(engine), drain_timeout=0.0) as running,
        httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r,
    ):
        chunks = r.iter_text()
        raw = next(chunks)
        running.server.should_exit = True  # what SIGTERM does to `asyncengine serve`
        raw += "".join(chunks)
    # No drain time: each sequence ends at once, with "abort", and the stream is well-formed.
    events = parse_sse(raw)
    finished = {
        e["choices"][0]["index"]: e["choices"][0]["finish_reason"]
        for e in events[:-1]
        if e["choices"][0]["finish_reason"] is not None
    }
    assert finished == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}


def test_a_full_queue_answers_503_with_retry_after(chat_model: Path) -> None:
    # One sequence runs at a time and one may wait: the third request finds the queue full.
    kw = {**ENGINE_KW, "max_num_seqs": 1, "max_queued_requests": 1}
    app = build_app(chat_model, core="thread", **kw)
    long = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        run_in_thread(app, drain_timeout=0.0) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        # 10 ms a step: the first request runs for 4 s, so it is still running (and the second
        # still queued) when the third arrives, however fast the tiny model is.
        core = running.state.engine._core_client.engine_core  # type: ignore[attr-defined]
        fault_injection.CORE_HOOKS["testing_delay_steps"](core, 0.01)
        with client.stream("POST", "/v1/completions", json=long) as first:
            next(first.iter_text())  # the first request runs: it has left the queue
            with client.stream("POST", "/v1/completions", json=long) as second:
                assert second.status_code == 200  # it waits in the queue, behind the first
                refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                error = refused.json()["error"]
                assert error["type"] == "ServiceUnavailableError"
                assert "max_queued_requests=1" in error["message"]


async def test_only_allowed_host_headers_are_answered(chat_model: Path) -> None:
    # Against DNS rebinding: a page whose own name resolves to 127.0.0.1 sends its own Host.
    app = build_app(chat_model, core="thread", allowed_hosts=["localhost"], **ENGINE_KW)
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://evil.example") as client:
        assert (await client.get("/v1/models")).status_code == 400
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost:8000") as client:
        assert (await client.get("/v1/models")).status_code == 200


def test_the_cli_answers_loopback_names_only_on_a_loopback_server() -> None:
    from asyncengine.entrypoints.cli import _allowed_hosts

    assert "localhost" in (_allowed_hosts("127.0.0.1", None) or [])
    assert _allowed_hosts("0.0.0.0", None) is None  # any: the operator chose to expose it
    assert _allowed_hosts("0.0.0.0", "api.example, 10.0.0.2") == ["api.example", "10.0.0.2"]
