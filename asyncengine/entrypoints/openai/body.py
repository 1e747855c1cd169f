"""Reading a request body: bounded in size, decoded into a request Struct in one step."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from asyncengine.entrypoints.openai.errors import OpenAIError, from_validation_error

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 as soon as it is known to exceed `limit` bytes.

    The declared Content-Length is checked before reading anything; a chunked body is counted
    as it arrives, so an oversized one is never held in memory.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nothing was started
        raise OpenAIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


async def decode_request(request: Request, limit: int, request_type: type[T]) -> T:
    """The body as `request_type`; 400 naming the field for JSON that does not fit it.

    415 unless the body is declared JSON: a browser page may send `text/plain` or a form to
    any host without asking first (no CORS preflight), but never `application/json`.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise OpenAIError(
            415,
            f"the request body must be JSON with Content-Type: application/json, not "
            f"{content_type or 'none'!r}",
        )
    body = await read_body(request, limit)
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise from_validation_error(exc) from None
    except UnicodeDecodeError as exc:
        raise OpenAIError(
            400, f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    except RecursionError:
        raise OpenAIError(400, "the request body's JSON is nested too deeply") from None


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than the limit of {limit} bytes")
