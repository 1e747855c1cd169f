"""Server-sent events: how a generation streams over HTTP, for the OpenAI server and the
framework integrations alike. No web framework is imported here (ASGI is a protocol).

- Encoding: each event is `data: <JSON>\\n\\n`, the stream ends with `data: [DONE]`; an error
  after the response has started is one more event, `data: {"error": {...}}`, before it.
  `output_events` is the integrations' plain format: one event per sequence that changed,
  `{"index", "text", "token_ids", "finish_reason"}`.
- Work that stops when its client goes away. Starlette's StreamingResponse iterates an async
  generator; when the client disconnects while the response is blocked in `send`, the
  generator is left suspended until it is collected, so the engine request behind it would
  run on for a while. `stream_until_disconnect` instead runs a producer coroutine in a task
  group beside a disconnect watcher: a disconnect cancels the producer at once, wherever it
  waits, and its `aclosing` blocks abort the engine requests. `call_until_disconnect` does the
  same for a non-streaming answer. (`entrypoints.sse_response.SSEResponse` is the Starlette
  response around it.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncengine.client.async_llm import AsyncLLM

T = TypeVar("T")

# ASGI's callables, as Starlette types them (starlette.types), without importing Starlette.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Sends one event's bytes to the client.
Emit = Callable[[bytes], Awaitable[None]]

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


# ---- encoding ---------------------------------------------------------------------------------


def event(data: object) -> bytes:
    """One `data:` event holding `data` as JSON (JSON has no raw newlines, so one line)."""
    return b"data: " + _encoder.encode(data) + b"\n\n"


def output_events(output: RequestOutput) -> bytes:
    """The events of one DELTA output: one per sequence that changed."""
    return b"".join(
        event(
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
        )
        for c in output.outputs
    )


def error_body(message: str, code: int) -> dict[str, object]:
    return {"error": {"message": message, "code": code}}


def delta_params(engine: AsyncLLM, params: SamplingParams | None) -> SamplingParams:
    """`params` (or the model's defaults) with DELTA outputs: each event carries only what is
    new."""
    params = params if params is not None else engine.get_default_sampling_params()
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)


# ---- ASGI: stop when the client goes away -----------------------------------------------------


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


# The headers of an event stream: no caching, and no proxy buffering (each event must reach
# the client when it is sent).
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def stream_until_disconnect(
    produce: Callable[[Emit], Awaitable[None]], receive: Receive, send: Send
) -> None:
    """Send the body of a started ASGI response: the events that `produce(emit)` emits, then
    the end of the body. A client disconnect cancels `produce` at once."""

    async def emit(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
        try:
            await produce(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # raised below as itself, not inside an exception group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
