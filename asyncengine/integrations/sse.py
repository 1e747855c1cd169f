"""The server-sent events of a generation, shared by the framework integrations.

Each new piece of a sequence is one event, `data: {"index", "text", "token_ids",
"finish_reason"}`, and the stream ends with `data: [DONE]`; an error after the response has
started is an event `data: {"error": {"message", "code"}}` before `[DONE]`. No framework is
imported here.
"""

from __future__ import annotations

import msgspec

from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def event(data: object) -> bytes:
    """One `data:` event holding `data` as JSON."""
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


def delta_params(params: SamplingParams | None) -> SamplingParams:
    """`params` with DELTA outputs: each event carries only what is new."""
    params = params if params is not None else SamplingParams()
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)
