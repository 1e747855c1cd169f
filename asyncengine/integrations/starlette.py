"""Starlette / FastAPI integration: a generation streamed as server-sent events.

Open the engine in the app's lifespan (see docs/integrations.md), then:

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        engine = request.app.state.engine
        return await stream_generation(engine, "Hello", SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from contextlib import aclosing

from starlette.responses import JSONResponse, Response

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.client.input_processor import Prompt
from asyncengine.entrypoints.sse import DONE, Emit, delta_params, error_body, event, output_events
from asyncengine.entrypoints.sse_response import EARLY_ERROR_WAIT_S, SSEResponse
from asyncengine.errors import EngineDeadError
from asyncengine.sampling_params import SamplingParams

# SSEResponse (and its default wait) is defined in entrypoints, where the OpenAI server uses it
# too; users import it from here.
__all__ = ["EARLY_ERROR_WAIT_S", "SSEResponse", "stream_generation"]


async def stream_generation(
    engine: AsyncLLM,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
) -> Response:
    """A response streaming one generation as server-sent events (see `entrypoints.sse`).

    The request is started before the response is returned, so a bad request is a 400 and a
    dead engine a 503 (JSON bodies). A client that disconnects aborts the request at once,
    even while the engine is still computing its next token.
    """
    stream = engine.generate(prompt, delta_params(engine, params), request_id=request_id)
    try:
        first = await anext(stream)
    except ValueError as exc:
        await stream.aclose()
        return JSONResponse(error_body(str(exc), 400), status_code=400)
    except EngineDeadError as exc:
        await stream.aclose()
        return JSONResponse(error_body(str(exc), 503), status_code=503)

    async def produce(emit: Emit) -> None:
        async with aclosing(stream):  # leaving early (a disconnect) aborts the request
            try:
                await emit(output_events(first))
                if not first.finished:
                    async for output in stream:
                        await emit(output_events(output))
            except EngineDeadError as exc:
                await emit(event(error_body(str(exc), 503)))
        await emit(DONE)

    return SSEResponse(produce)
