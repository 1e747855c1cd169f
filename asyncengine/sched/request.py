"""Request: one sequence's state inside the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncengine.ipc.messages import EngineCoreRequest, FinishReason
from asyncengine.sampling_params import SamplingParams


def resolve_max_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """The output budget: max_tokens, or what max_model_len leaves (if smaller or unset)."""
    room = max_model_len - num_prompt_tokens
    return room if params.max_tokens is None else min(params.max_tokens, room)


def check_fits_kv_cache(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """ValueError when the request could outgrow the whole KV cache (it would never finish)."""
    needed = -(-(num_prompt_tokens + max_tokens) // block_size)
    if needed > num_blocks:
        raise ValueError(
            f"request {request_id!r} may need {needed} KV blocks ({num_prompt_tokens} prompt + "
            f"{max_tokens} new tokens) but the cache holds only {num_blocks}: lower max_tokens "
            "or enlarge the KV cache"
        )


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler tracks it: its tokens and how many have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet scheduled)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # filled by the KV cache manager
    max_tokens: int = 0  # output budget, resolved against max_model_len

    @classmethod
    def from_core_request(
        cls, req: EngineCoreRequest, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> Request:
        params = req.sampling_params
        max_tokens = resolve_max_tokens(len(req.prompt_token_ids), params, max_model_len)
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=params,
            eos_token_ids=eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.priority,
            all_token_ids=list(req.prompt_token_ids),
            max_tokens=max_tokens,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
