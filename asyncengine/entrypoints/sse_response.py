"""The Starlette response that streams server-sent events, for the OpenAI server and the
Starlette / FastAPI integration alike (`asyncengine.integrations.starlette` re-exports it).

It lives beside `entrypoints/sse.py` rather than in it because it needs Starlette, and sse.py
needs no web framework: the aiohttp integration uses sse.py without Starlette installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from asyncengine.entrypoints.sse import SSE_HEADERS, Emit, stream_until_disconnect

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
