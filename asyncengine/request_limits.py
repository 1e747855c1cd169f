"""The limits every request must fit: prompt length, output budget, KV cache size.

One module, so the client (which refuses a request in the caller) and the engine core (which
guards itself against any client) apply the same rules with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncengine.sampling_params import DEFAULT_MAX_TOKENS, CoreSamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine can hold: `max_model_len` tokens a sequence, `num_kv_blocks` blocks of
    `block_size` tokens in all."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int  # a request's `n` sequences must be able to run at once

    def check(self, request_id: str, num_prompt_tokens: int, params: CoreSamplingParams) -> int:
        """The request's output budget (see `resolve_max_tokens`); ValueError, naming the
        limit, when the prompt leaves no room within max_model_len, the request could
        outgrow the whole KV cache (it would never finish), or it asks for more sequences
        than the engine runs at once."""
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"SamplingParams.n={params.n} is invalid: at most max_num_seqs="
                f"{self.max_num_seqs} sequences of one request can run at once"
            )
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


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size) and there is at least one."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = [t for t in token_ids if not 0 <= t < vocab_size][:5]
        raise ValueError(
            f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary); got {bad}"
        )


def resolve_max_tokens(
    num_prompt_tokens: int, params: CoreSamplingParams, max_model_len: int
) -> int:
    """The output budget: max_tokens, or what max_model_len leaves (if smaller or unset)."""
    room = max_model_len - num_prompt_tokens
    max_tokens = params.max_tokens
    if max_tokens is msgspec.UNSET:  # resolved by the client; a raw frame may leave it out
        max_tokens = DEFAULT_MAX_TOKENS
    return room if max_tokens is None else min(max_tokens, room)
