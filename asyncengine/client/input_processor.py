"""InputProcessor: a user's prompt and params → a validated ProcessedRequest, whose
EngineCoreRequests go to the core.

Every check that depends only on the request happens here, once, on the caller's side (the
params, the prompt, and the engine's limits: `RequestLimits`), so a bad request is refused
with a ValueError before it reaches the core.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import msgspec

from asyncengine.client.chat import ChatPrompt
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import EngineCoreRequest
from asyncengine.request_limits import RequestLimits, check_token_ids
from asyncengine.sampling_params import (
    DEFAULT_MAX_TOKENS,
    SamplingParams,
    default_sampling_params,
)

Prompt = str | Sequence[int]


@dataclass(slots=True)
class ProcessedRequest:
    """A request ready for the core: `core_requests` holds one EngineCoreRequest per sequence
    (`params.n` of them); the rest is what the client keeps to shape its outputs."""

    request_id: str
    prompt: str | None  # the prompt's text, when it was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        limits: RequestLimits,
        sampling_defaults: Iterable[tuple[str, float | int]] = (),
    ) -> None:
        """`sampling_defaults`: the model's (ModelConfig.sampling_defaults), for requests that
        come without a SamplingParams."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.sampling_defaults = tuple(sampling_defaults)

    def default_params(self) -> SamplingParams:
        """A new SamplingParams holding the model's sampling defaults (generation_config.json);
        the fields it does not name keep SamplingParams' own defaults."""
        return default_sampling_params(self.sampling_defaults)

    def tokenize(self, prompt: Prompt | ChatPrompt) -> tuple[str | None, list[int]]:
        """The prompt's text (if given as text) and its token ids, validated."""
        token_ids: list[int]
        text: str | None
        if isinstance(prompt, ChatPrompt):  # rendered and encoded by render_chat
            text = prompt.text
            token_ids = list(prompt.token_ids)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give a non-empty string or token ids")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = list(cast("Sequence[int]", prompt))
            text = None
            not_ints = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)]
            if not_ints:
                raise ValueError(f"prompt token ids must be integers; got {not_ints[:5]!r}")
            check_token_ids(token_ids, self.vocab_size)
        else:
            raise ValueError(
                f"prompt must be a string or a sequence of token ids, not {type(prompt).__name__}"
            )
        if not token_ids:
            raise ValueError("prompt is empty after tokenisation: give at least one token")
        return text, token_ids

    def process(
        self,
        prompt: Prompt | ChatPrompt,
        params: SamplingParams | None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        pooling: str | None = None,
        lora_name: str | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenise; ValueError naming what is wrong. `pooling`: an embedding
        request (EngineCoreRequest.pooling); `lora_name`: its LoRA adapter."""
        if params is None:
            params = self.default_params()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        else:
            params.validate()  # again: a SamplingParams may have been changed since it was made
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, not {request_id!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, not {priority!r}")
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority={priority} is invalid: must fit in 64 bits")
        text, token_ids = self.tokenize(prompt)
        if params.max_tokens is msgspec.UNSET:
            chat = isinstance(prompt, ChatPrompt)
            max_tokens = self._chat_max_tokens(len(token_ids)) if chat else DEFAULT_MAX_TOKENS
            params = msgspec.structs.replace(params, max_tokens=max_tokens)
        self.limits.check(request_id, len(token_ids), params)
        arrival = time.monotonic()
        core_requests = [
            EngineCoreRequest(
                request_id=core_id,
                prompt_token_ids=token_ids,
                sampling_params=_child_params(params, i),
                arrival_time=arrival,
                priority=priority,
                pooling=pooling,
                lora_name=lora_name,
            )
            for i, core_id in enumerate(sequence_ids(request_id, params.n))
        ]
        return ProcessedRequest(request_id, text, token_ids, params, core_requests)

    def _chat_max_tokens(self, num_prompt_tokens: int) -> int | None:
        """A chat's output budget when none is given: until the model stops or the context
        ends (OpenAI's chat default), or the KV cache is full where it holds fewer tokens than
        max_model_len (so the request is not refused for a budget it did not ask for)."""
        limits = self.limits
        cache_room = limits.num_kv_blocks * limits.block_size - num_prompt_tokens
        if cache_room >= limits.max_model_len - num_prompt_tokens:
            return None
        return max(1, cache_room)


def request_limits(config: EngineConfig) -> RequestLimits:
    """The limits of an engine whose core is ready (its config names the KV block count)."""
    num_kv_blocks = config.cache_config.num_kv_blocks
    if num_kv_blocks is None:
        raise RuntimeError("the KV block count is known once the engine core is ready")
    return RequestLimits(
        config.model_config.max_model_len,
        config.cache_config.block_size,
        num_kv_blocks,
        config.scheduler_config.max_num_seqs,
    )


def sequence_ids(request_id: str, n: int) -> list[str]:
    """Core-side ids of a request's n sequences (the request id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    import msgspec

    # Each sequence samples alone; a seeded request gives its sequences distinct seeds. The
    # prompt's logprobs are the same for all: the first sequence computes them.
    seed = None if params.seed is None else (params.seed + index) % 2**63
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
