"""Server-sent events, and work that stops when its client goes away.

Starlette's StreamingResponse iterates an async generator; when the client disconnects while
the response is blocked in `send`, the generator is left suspended until it is collected, so
the engine request behind it would run on for a while. `SSEResponse` instead runs a producer
coroutine in a task group beside a disconnect watcher: a disconnect cancels the producer at
once, wherever it waits, and its `aclosing` blocks abort the engine requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

# Sends one event's bytes to the client.
Emit = Callable[[bytes], Awaitable[None]]

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(data: object) -> bytes:
    """One `data:` event holding `data` as JSON (JSON has no raw newlines, so one line)."""
    return b"data: " + _encoder.encode(data) + b"\n\n"


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def call_until_disconnect(receive: Receive, func: Callable[[], Awaitable[T]]) -> T | None:
    """`await func()`, cancelled if the client disconnects first (then None).

    For requests whose body has been read: the next ASGI message is the disconnect.
    """
    result: T | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
        try:
            result = await func()
        except Exception as exc:  # raised below as itself, not inside an exception group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class SSEResponse(Response):
    """A `text/event-stream` response whose events come from `produce(emit)`."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        self.produce = produce
        self.status_code = 200
        self.background: BackgroundTask | None = None
        # no-cache and no proxy buffering: each event must reach the client when it is sent
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            try:
                await self.produce(emit)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception as exc:  # raised below as itself, not inside an exception group
                error = exc
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
