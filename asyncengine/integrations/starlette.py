"""Starlette / FastAPI integration: a generation streamed as server-sent events.

Open the engine in the app's lifespan (see docs/integrations.md), then:

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        engine = request.app.state.engine
        return await stream_generation(engine, "Hello", SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import aclosing

import anyio
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.client.input_processor import Prompt
from asyncengine.entrypoints.sse import (
    DONE,
    SSE_HEADERS,
    Emit,
    delta_params,
    error_body,
    event,
    output_events,
    stream_until_disconnect,
)
from asyncengine.errors import EngineDeadError
from asyncengine.sampling_params import SamplingParams

# How long a stream's status line may wait, by default, for a request's first output (or its
# refusal).
EARLY_ERROR_WAIT_S = 1.0


class SSEResponse(Response):
    """A `text/event-stream` response whose events come from `produce(emit)`; a client that
    disconnects cancels `produce` at once (`entrypoints.sse.stream_until_disconnect`).

    With `early_error`, the status line goes out with the first event, or after `wait_s`
    at the latest: if `produce` raises before either and `early_error` maps the exception to
    a response, the client gets that response (a 400 for a constraint the engine could not
    compile, say) instead of a stream. A request that waits in a queue for longer still gets
    its headers then, so that clients see it accepted.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Emit], Awaitable[None]],
        *,
        early_error: Callable[[Exception], Response | None] | None = None,
        wait_s: float = EARLY_ERROR_WAIT_S,
    ) -> None:
        self.produce = produce
        self.early_error = early_error
        self.wait_s = wait_s
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        lock = anyio.Lock()  # the start must reach the server before any body

        async def start() -> None:
            nonlocal started
            async with lock:
                if not started:
                    start = {"type": "http.response.start", "status": self.status_code}
                    await send({**start, "headers": self.raw_headers})
                    started = True

        async def send_started(message: Message) -> None:
            # Once started, straight through: the lock's checkpoint cost every event a trip
            # through the event loop (per token of every stream).
            if not started:
                await start()
            await send(message)

        async def start_after_wait() -> None:
            await anyio.sleep(self.wait_s)
            await start()

        if self.early_error is None:
            await start()
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            if self.early_error is not None:
                tg.start_soon(start_after_wait)
            try:
                await stream_until_disconnect(self.produce, receive, send_started)
            except Exception as exc:  # handled below, not inside an exception group
                error = exc
            tg.cancel_scope.cancel()
        if error is None:
            return
        response = None if started or self.early_error is None else self.early_error(error)
        if response is None:
            raise error
        await response(scope, receive, send)


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
