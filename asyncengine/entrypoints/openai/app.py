"""The OpenAI-compatible Starlette app: routes, API-key check, error shape, engine lifespan.

GET  /v1/models, /v1/models/{model}     the served model, and its LoRA adapters
POST /v1/load_lora_adapter, /v1/unload_lora_adapter   serving_lora.py (with
                                        enable_lora_runtime_updates)
POST /v1/completions                    serving_completion.py
POST /v1/chat/completions               serving_chat.py
POST /v1/embeddings                     serving_embeddings.py
POST /v1/responses                      serving_responses.py (stateless: nothing is stored)
GET  /health                            200 after a real round trip to the core (its body:
                                        "ok" or "degraded", with each rank's state), else 503
GET  /metrics                           Prometheus text (metrics.py)
GET  /version                           asyncengine's version
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.entrypoints.openai.errors import OpenAIError
from asyncengine.entrypoints.openai.metrics import CONTENT_TYPE
from asyncengine.entrypoints.openai.protocol import ModelCard, ModelList
from asyncengine.entrypoints.openai.reasoning import reasoning_parser as reasoning_parser_named
from asyncengine.entrypoints.openai.serving_chat import ChatServing
from asyncengine.entrypoints.openai.serving_completion import CompletionServing
from asyncengine.entrypoints.openai.serving_embeddings import EmbeddingServing
from asyncengine.entrypoints.openai.serving_lora import LoRAServing, add_lora_modules
from asyncengine.entrypoints.openai.serving_responses import ResponsesServing
from asyncengine.entrypoints.openai.state import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerState
from asyncengine.errors import EngineDeadError
from asyncengine.gguf.serving import served_model_name as served_model_name_of
from asyncengine.version import __version__

# A health check that takes longer than this reports the engine unhealthy (hung, or stuck in
# a very long step).
HEALTH_CHECK_TIMEOUT_S = 5.0
# Paths that answer without an API key: load balancers and orchestrators probe them.
_PUBLIC_PATHS = frozenset({"/health"})


def build_app(
    engine: AsyncLLM | str | os.PathLike[str],
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    allowed_hosts: Sequence[str] | None = None,
    metrics_dir: str | None = None,
    api_server_index: int = 0,
    reasoning_parser: str | None = None,
    lora_modules: Mapping[str, str] | None = None,
    enable_lora_runtime_updates: bool = False,
    **engine_options: Any,
) -> Starlette:
    """The OpenAI-compatible app over `engine`: an AsyncLLM, or a model folder to build one
    from with `engine_options` (AsyncLLM.from_pretrained's keywords; bad ones raise here).

    The app's lifespan starts the engine and stops it, unless it is already running when the
    app starts (then whoever started it owns it). `served_model_name` is the `model` clients
    ask for (default: the model folder's name: its path is never shown to clients);
    `api_key`, when set, is required as `Authorization: Bearer KEY` on every path but /health.
    `allowed_hosts`, when given, are the only `Host` headers answered (400 otherwise): against
    DNS rebinding, a web page that reaches a local server under a name of its own.
    `metrics_dir` and `api_server_index`: set by `serve --api-server-count`, whose API server
    processes share their metrics there (each scrape reports the sum).
    `reasoning_parser` ("deepseek_r1", "qwen3"; see reasoning.py) splits a model's thinking
    from its answer in chat completions; ValueError for an unknown name.
    `lora_modules` (name -> PEFT folder) are loaded as the app starts (the engine needs
    `enable_lora`); requests name one in their `model` field. `enable_lora_runtime_updates`
    adds /v1/load_lora_adapter and /v1/unload_lora_adapter (serving_lora.py).
    """
    parser = reasoning_parser_named(reasoning_parser)  # before a model is loaded for nothing
    if not isinstance(engine, AsyncLLM):
        engine = AsyncLLM.from_pretrained(engine, **engine_options)
    elif engine_options:
        raise TypeError("engine options are for a model folder, not for an AsyncLLM")
    if not max_request_body_bytes > 0:
        raise ValueError(f"max_request_body_bytes={max_request_body_bytes!r} must be > 0")
    state = ServerState(
        engine,
        served_model_name or served_model_name_of(engine.config.model_config.model),
        max_request_body_bytes=max_request_body_bytes,
        metrics_dir=metrics_dir,
        api_server_index=api_server_index,
    )
    endpoints = _Endpoints(state)
    routes = [
        Route("/v1/models", endpoints.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", endpoints.retrieve_model, methods=["GET"]),
        Route("/v1/completions", CompletionServing(state).create, methods=["POST"]),
        Route("/v1/chat/completions", ChatServing(state, parser).create, methods=["POST"]),
        Route("/v1/embeddings", EmbeddingServing(state).create, methods=["POST"]),
        Route("/v1/responses", ResponsesServing(state, parser).create, methods=["POST"]),
        Route("/health", endpoints.health, methods=["GET"]),
        Route("/metrics", endpoints.metrics, methods=["GET"]),
        Route("/version", endpoints.version, methods=["GET"]),
    ]
    if enable_lora_runtime_updates:
        lora = LoRAServing(state)
        routes.append(Route("/v1/load_lora_adapter", lora.load, methods=["POST"]))
        routes.append(Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]))
    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    if allowed_hosts is not None:
        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if metrics_dir is not None:
                tg.start_soon(_share_metrics, state)
            if engine.is_running:
                await add_lora_modules(state, lora_modules or {})
                yield
            else:
                async with engine:
                    await add_lora_modules(state, lora_modules or {})
                    yield
            tg.cancel_scope.cancel()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={OpenAIError: _openai_error, HTTPException: _http_error},
    )
    app.state.openai = state
    return app


async def _share_metrics(state: ServerState) -> None:
    """Keep this API server process's counts fresh for the others' scrapes."""
    while True:
        await anyio.to_thread.run_sync(state.metrics.write_snapshot)
        await anyio.sleep(0.5)


def server_state(app: Starlette) -> ServerState:
    """The state behind an app made by `build_app` (engine, served name, metrics)."""
    state = app.state.openai
    assert isinstance(state, ServerState)
    return state


class _Endpoints:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def list_models(self, request: Request) -> Response:
        await self.state.refresh_loras()
        adapters = [self._card(name) for name in self.state.engine.lora_names]
        return _json(ModelList(data=[self._card(), *adapters]))

    async def retrieve_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        lora = await self.state.lora_for(name)
        return _json(self._card(None if lora is None else lora.name))

    def _card(self, adapter: str | None = None) -> ModelCard:
        config = self.state.engine.config.model_config
        # `root` is the served name, as in vLLM: the model folder's path stays private (and
        # so does an adapter's: its root is its name, its parent the served model).
        name = self.state.model_name
        return ModelCard(
            id=name if adapter is None else adapter,
            created=int(self.state.created),
            root=name if adapter is None else adapter,
            max_model_len=config.max_model_len,
            parent=None if adapter is None else name,
        )

    async def health(self, request: Request) -> Response:
        state = self.state
        state.check_ready()
        try:
            health = await state.engine.check_health(timeout=HEALTH_CHECK_TIMEOUT_S)
        except EngineDeadError as exc:
            raise OpenAIError(503, f"the engine is dead: {exc}") from exc
        except Exception as exc:  # hung (TimeoutError), or closing meanwhile
            raise OpenAIError(503, f"the engine is unhealthy: {exc}") from exc
        # 200 while any rank serves; the body says which ranks are dead (data parallel).
        return _json(
            {
                "status": health.status,
                "ranks": [
                    {"rank": r.rank, "healthy": r.healthy, "error": r.error} for r in health.ranks
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        engine = self.state.engine
        stats = None
        if engine.is_running:
            try:
                stats = await engine.statistics(timeout=HEALTH_CHECK_TIMEOUT_S)
            except Exception:  # dead or hung: report the server's own metrics only
                stats = None
        metrics = self.state.metrics
        if metrics.shared_dir is None:
            text = metrics.render(stats)
        else:  # reads the other API server processes' files: off the event loop
            text = await anyio.to_thread.run_sync(metrics.render, stats)
        return Response(text, media_type=CONTENT_TYPE)

    async def version(self, request: Request) -> Response:
        return _json({"version": __version__})


class APIKeyMiddleware:
    """401 unless the request carries `Authorization: Bearer KEY` (every path but /health).

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between every
    streamed event and the client.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in _PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(401, "a valid API key is required: Authorization: Bearer KEY")
        response = _error_response(error)
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    # Mounted under a prefix, the app sees the full path; its routes are relative to root_path.
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _json(content: object) -> Response:
    return Response(msgspec.json.encode(content), media_type="application/json")


def _error_response(error: OpenAIError) -> Response:
    return error.response()


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own errors (no such route, wrong method) in OpenAI's shape too.
    assert isinstance(exc, HTTPException)
    return _error_response(OpenAIError(exc.status_code, exc.detail))
