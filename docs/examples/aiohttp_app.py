"""An aiohttp app that owns an AsyncLLM and streams generations as server-sent events.

    python docs/examples/aiohttp_app.py path/to/model
    curl -N localhost:8080/generate -d '{"prompt": "Hello", "max_tokens": 32}'

Each event is `data: {"index", "text", "token_ids", "finish_reason"}`; the stream ends with
`data: [DONE]`. Closing the connection aborts the request in the engine.
"""

from __future__ import annotations

import sys
from typing import Any

from aiohttp import web

from asyncengine import SamplingParams
from asyncengine.integrations.aiohttp import ENGINE_KEY, EngineContext, stream_generation


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, str):
        raise web.HTTPBadRequest(text="the body needs a string `prompt`")
    try:
        params = SamplingParams(
            max_tokens=body.get("max_tokens", 64),
            temperature=body.get("temperature", 1.0),
            seed=body.get("seed"),
        )
    except ValueError as exc:  # the message names the field and its allowed range
        raise web.HTTPBadRequest(text=str(exc)) from None
    return await stream_generation(request, request.app[ENGINE_KEY], prompt, params)


def make_app(model: str, **engine_options: Any) -> web.Application:
    """The app; the engine starts with it and stops at its cleanup."""
    app = web.Application()
    app.cleanup_ctx.append(EngineContext(model, **engine_options))
    app.router.add_post("/generate", generate)
    return app


if __name__ == "__main__":  # only so that importing this module does not start a server
    web.run_app(make_app(sys.argv[1]), host="127.0.0.1", port=8080)
