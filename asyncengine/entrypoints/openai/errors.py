"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

`type` follows vLLM's names (BadRequestError, NotFoundError, ...), which the official `openai`
client maps to its exception classes by status code anyway; `code` repeats the HTTP status.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

import msgspec
from starlette.responses import Response

from asyncengine.errors import EngineDeadError, EngineDrainingError, EngineOverloadedError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# msgspec names the offending field at the end of its message: "... - at `$.temperature`",
# "... - at `$.messages[0].role`", or "Object missing required field `prompt`".
_MSGSPEC_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MSGSPEC_MISSING = re.compile(r"missing required field `([^`]+)`")
# SamplingParams' ValueErrors start with "SamplingParams.<field>=<value> is invalid"; the
# engine's other checks of a request's fields with "<field>=<value> is invalid".
_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+)=")
_FIELD = re.compile(r"^(\w+)=\S")


class OpenAIError(Exception):
    """A request that ends in an error response: status, message and the offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers  # extra response headers (Retry-After on a 503)

    def body(self) -> dict[str, object]:
        error_type = _ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase.replace(" ", ""))
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def json(self) -> bytes:
        return msgspec.json.encode(self.body())

    def response(self) -> Response:
        """This error as an HTTP response (JSON body, its status and headers)."""
        return Response(
            self.json(),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> OpenAIError:
    """A 400 for a body that is not JSON, or whose JSON does not fit the request's schema."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        path = ""
        if (m := _MSGSPEC_PATH.search(text)) is not None:
            path, text = m.group(1), text[: m.start()]
        if (m := _MSGSPEC_MISSING.search(text)) is not None:
            path = f"{path}.{m.group(1)}" if path else m.group(1)
        elif path:
            text += f" at `{path}`"
        return bad_request(f"invalid request body: {text}", path or None)
    return bad_request(f"the request body is not valid JSON: {text}")


def from_value_error(exc: ValueError, renames: dict[str, str] | None = None) -> OpenAIError:
    """A 400 for a request the engine refused (SamplingParams or prompt checks).

    `renames` maps SamplingParams fields to the endpoint's parameter names (e.g. chat's
    `logprobs` count is its `top_logprobs`).
    """
    text = str(exc)
    param = None
    if (m := _SAMPLING_FIELD.match(text)) is not None:
        param = m.group(1)
        text = text[len("SamplingParams.") :]
        if renames and param in renames:
            text = renames[param] + text[len(param) :]
            param = renames[param]
    elif (m := _FIELD.match(text)) is not None:
        param = m.group(1)
    return bad_request(text, param)


def error_for(exc: Exception) -> OpenAIError:
    """The error response for an exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is dead: {exc}")
    if isinstance(exc, EngineOverloadedError):
        # Requests leave the queue in seconds at most: a client that waits one retries well.
        return OpenAIError(503, f"the server is overloaded: {exc}", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDrainingError):
        return OpenAIError(503, f"the server is shutting down: {exc}")
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    logger.error("error while serving a request", exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}")
