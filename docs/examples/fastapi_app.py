"""FastAPI with asyncengine: the engine opened in the app's lifespan, a custom streaming
endpoint, and the OpenAI-compatible API mounted beside it.

    python docs/examples/fastapi_app.py path/to/model
    curl -N localhost:8000/generate -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 32}'
    curl localhost:8000/openai/v1/models
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from starlette.responses import Response

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.entrypoints.openai import build_app
from asyncengine.integrations.starlette import stream_generation


class GenerateBody(BaseModel):
    prompt: str
    max_tokens: int = 64
    temperature: float = 1.0


def make_app(model: str, **engine_options: Any) -> FastAPI:
    # Built here (settings are checked at once), started by the lifespan below.
    engine = AsyncLLM.from_pretrained(model, **engine_options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine:  # leaving it aborts what is in flight and stops the core
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Response:
        try:
            params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return await stream_generation(engine, body.prompt, params)

    # The OpenAI-compatible routes, sharing the same engine. A mounted app's own lifespan
    # does not run: the engine is started by the lifespan above.
    app.mount("/openai", build_app(engine, served_model_name="local"))
    return app


if __name__ == "__main__":  # only so that importing this module does not start a server
    import uvicorn

    uvicorn.run(make_app(sys.argv[1]), host="127.0.0.1", port=8000)
