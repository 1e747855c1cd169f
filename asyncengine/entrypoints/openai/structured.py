"""A request's output constraint: OpenAI's `response_format`, or vLLM's `structured_outputs`
extension, → `StructuredOutputsParams` (a 400 naming the parameter when malformed)."""

from __future__ import annotations

import math
import re
from typing import Any

from asyncengine.entrypoints.openai.errors import bad_request
from asyncengine.entrypoints.openai.protocol import _SamplingRequest
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# How long a constrained stream's status line waits for its first output: until it comes.
# The core compiles the constraint first (seconds for a core's first, which loads xgrammar),
# and one it cannot compile must be a 400 naming it. After a shorter wait the status went out
# first, and the refusal then broke the stream off with no event at all.
CONSTRAINED_STREAM_WAIT_S = math.inf
_CLIENT_PREFIX = re.compile(r"^request '[^']*' is invalid: ")
_SCHEMA_PLACES = {
    "response_format": "response_format.json_schema.schema",
    "tools": "a schema of tools[].function.parameters",
}


def request_constraint(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint the request asks for, if any; at most one of the two ways."""
    from_format = _from_response_format(req.response_format)
    from_extension = _from_extension(req.structured_outputs)
    if from_format is not None and from_extension is not None:
        raise bad_request(
            "give response_format or structured_outputs, not both", "structured_outputs"
        )
    return from_format or from_extension


def constraint_error(exc: Exception, req: _SamplingRequest, tools_constrain: bool) -> Exception:
    """The 400 for a constraint the engine could not compile, naming the parameter that
    carried it; any other exception as it is."""
    if not isinstance(exc, InvalidRequestError):
        return exc
    param: str | None
    if req.response_format is not None and req.response_format.get("type") != "text":
        param = "response_format"
    elif req.structured_outputs is not None:
        param = "structured_outputs"
    else:
        param = "tools" if tools_constrain else None
    # The core names the constraint as StructuredOutputsParams holds it; name it as sent.
    message = _CLIENT_PREFIX.sub("", str(exc))
    if param is not None:
        place = _SCHEMA_PLACES.get(param, param)
        message = message.replace("structured_outputs.json ", f"{place} ")
    return bad_request(message, param)


def _from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format.type={kind!r} is invalid: must be one of "
            f"{', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema is required with type json_schema: "
            '{"name": ..., "schema": {...}, "strict": true}',
            "response_format",
        )
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's shape names it `schema`; some clients send `json_schema` itself as the schema.
        schema = {k: v for k, v in spec.items() if k not in ("name", "description", "strict")}
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise bad_request(
            f"response_format.json_schema.schema is invalid: {exc}", "response_format"
        ) from None


def _from_extension(ext: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if ext is None:
        return None
    unknown = sorted(set(ext) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise bad_request(
            f"structured_outputs has unknown keys {unknown}: allowed are "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}",
            "structured_outputs",
        )
    given = {k: v for k, v in ext.items() if v is not None and v is not False}
    try:
        return StructuredOutputsParams(**given)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"structured_outputs is invalid: {exc}", "structured_outputs") from None
