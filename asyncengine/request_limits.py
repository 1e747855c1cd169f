"""The limits every request must fit: prompt length, output budget, KV cache size.

One module, so the client (which refuses a request in the caller) and the engine core (which
guards itself against any client) apply the same rules with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.sampling_params import CoreSamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine can hold: `max_model_len` tokens a sequence, `num_kv_blocks` blocks of
    `block_size` tokens in all."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int

    def check(self, request_id: str, num_prompt_tokens: int, params: CoreSamplingParams) -> int:
        """The request's output budget (see `resolve_max_tokens`); ValueError, naming the
        limit, when the prompt leaves no room within max_model_len or the request could
        outgrow the whole KV cache (it would never finish)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter, leaving room for at least one "
                "new token"
            )
        max_tokens = resolve_max_tokens(num_prompt_tokens, params, self.max_model_len)
        needed = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"request {request_id!r} may need {needed} KV blocks ({num_prompt_tokens} "
                f"prompt + {max_tokens} new tokens) but the cache holds only "
                f"{self.num_kv_blocks}: lower max_tokens or enlarge the KV cache"
            )
        return max_tokens


def resolve_max_tokens(
    num_prompt_tokens: int, params: CoreSamplingParams, max_model_len: int
) -> int:
    """The output budget: max_tokens, or what max_model_len leaves (if smaller or unset)."""
    room = max_model_len - num_prompt_tokens
    return room if params.max_tokens is None else min(params.max_tokens, room)
