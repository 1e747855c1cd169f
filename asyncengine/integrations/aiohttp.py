"""aiohttp integration: an engine owned by the app's `cleanup_ctx`, generations as SSE.

app = web.Application()
app.cleanup_ctx.append(EngineContext("path/to/model", max_num_seqs=64))

async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    return await stream_generation(request, engine, "Hello", SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.client.input_processor import Prompt
from asyncengine.entrypoints.sse import DONE, delta_params, error_body, event, output_events
from asyncengine.errors import EngineDeadError
from asyncengine.sampling_params import SamplingParams

ENGINE_KEY: web.AppKey[AsyncLLM] = web.AppKey("asyncengine.engine", AsyncLLM)


class EngineContext:
    """A cleanup context that owns an engine: started with the app, stopped at its cleanup
    (aborting what is in flight), and available as `app[ENGINE_KEY]` in between.

    `engine` is an AsyncLLM not yet started, or a model folder to build one from with
    `options` (AsyncLLM.from_pretrained's keywords; bad ones raise here, not at start-up).
    """

    def __init__(
        self,
        engine: AsyncLLM | str | os.PathLike[str],
        *,
        key: web.AppKey[AsyncLLM] = ENGINE_KEY,
        **options: Any,
    ) -> None:
        if not isinstance(engine, AsyncLLM):
            engine = AsyncLLM.from_pretrained(engine, **options)
        elif options:
            raise TypeError("engine options are for a model folder, not for an AsyncLLM")
        self.engine = engine
        self.key = key

    async def __call__(self, app: web.Application) -> AsyncIterator[None]:
        async with self.engine:
            app[self.key] = self.engine
            yield


async def stream_generation(
    request: web.Request,
    engine: AsyncLLM,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
) -> web.StreamResponse:
    """Stream one generation to the client as server-sent events (see `entrypoints.sse`).

    The request is started before any header is sent, so a bad request is a 400 and a dead
    engine a 503 (JSON bodies). A client that goes away aborts the request at the next write.
    """
    stream = engine.generate(prompt, delta_params(engine, params), request_id=request_id)
    async with aclosing(stream):  # leaving early aborts the request in the engine
        try:
            first = await anext(stream)
        except ValueError as exc:
            raise _http_error(web.HTTPBadRequest, str(exc), 400) from None
        except EngineDeadError as exc:
            raise _http_error(web.HTTPServiceUnavailable, str(exc), 503) from None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            await response.write(output_events(first))
            if not first.finished:
                async for output in stream:
                    await response.write(output_events(output))
        except EngineDeadError as exc:
            await response.write(event(error_body(str(exc), 503)))
        except ConnectionResetError:
            return response  # the client went away; closing the stream aborts the request
        await response.write(DONE)
        await response.write_eof()
    return response


def _http_error(cls: type[web.HTTPException], message: str, code: int) -> web.HTTPException:
    body = msgspec.json.encode(error_body(message, code)).decode()
    return cls(text=body, content_type="application/json")
