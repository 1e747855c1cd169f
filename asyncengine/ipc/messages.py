"""Wire types between the client and the engine core.

Pipeline: EngineCoreRequest → (core) → EngineCoreOutputs → OutputProcessor → RequestOutput.
Every message is a `msgspec.Struct` (array_like for compact frames, gc=False because they hold
no cycles); they are decoded with typed decoders, never pickled.
"""

from __future__ import annotations

import enum

import msgspec

from asyncengine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenised request, as the core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0


# One sampled position's logprobs: token ids (sampled first, then the top-N), their logprobs,
# and the sampled token's rank in the distribution (1 = most likely).
LogprobsEntry = tuple[list[int], list[float], int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Every request's new tokens of one step, in one message."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
