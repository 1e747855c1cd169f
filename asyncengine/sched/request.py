"""Request: one sequence's state inside the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncengine.ipc.messages import EngineCoreRequest, FinishReason
from asyncengine.sampling_params import CoreSamplingParams
from asyncengine.sched.structured_outputs import RequestGrammar


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
    sampling_params: CoreSamplingParams
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
    grammar: RequestGrammar | None = None  # structured outputs: its matcher follows the outputs
    pooling: str | None = None  # an embedding request: prefilled, pooled, never decoded
    lora_name: str | None = None  # its LoRA adapter; None: the base model
    # The first block's parent hash: b"" for the base model, the adapter's salt otherwise, so
    # a prefix cached under one adapter is never reused by another (or by the base).
    hash_seed: bytes = b""

    @classmethod
    def from_core_request(cls, req: EngineCoreRequest, max_tokens: int) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            arrival_time=req.arrival_time,
            priority=req.priority,
            all_token_ids=list(req.prompt_token_ids),
            max_tokens=max_tokens,
            pooling=req.pooling,
            lora_name=req.lora_name,
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
