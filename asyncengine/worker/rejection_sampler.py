"""Verifying draft tokens: which of a row's drafts the model accepts (speculative decoding).

A row with drafts d_0..d_{k-1} is computed at k + 1 positions in one forward: position i sees
the request's tokens and d_0..d_{i-1}. The sampler draws one token t_i at each position from
the model's distribution p_i there, exactly as it would without speculation (`draft_states`
gives position i the outputs, hence the seed step, penalties and min_tokens, it would have had
if d_0..d_{i-1} were sampled), and `accept_drafts` keeps d_i while t_i == d_i, then emits t_i
at the first mismatch (or t_k, the bonus token, when every draft matched).

For greedy rows that is the argmax rule: the output is token for token the one without
speculation. For sampled rows it is rejection sampling (Leviathan et al. 2023, Chen et al.
2023) with n-gram drafts, whose proposal q is a point mass on d_i: d_i is accepted with
probability P(t_i = d_i) = p_i(d_i) = min(1, p_i(d_i) / q(d_i)), and on a rejection the
emitted t_i is distributed as p_i given t_i != d_i, which is max(p_i - q, 0) normalised. So every
emitted token has the model's own distribution, and a seeded request, whose noise at each
output position depends only on (seed, position), gives the same tokens with or without
speculation, up to floating point in the logits.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncengine.worker.sampling_metadata import SamplingRequestState


def draft_states(state: SamplingRequestState, drafts: Sequence[int]) -> list[SamplingRequestState]:
    """The sampling states of a row's 1 + len(drafts) positions: position i samples as the
    request would after d_0..d_{i-1} were its outputs (position 0 is `state` itself)."""
    states = [state]
    for i in range(1, len(drafts) + 1):
        outputs = state.output_token_ids + list(drafts[:i])
        states.append(
            SamplingRequestState(
                params=state.params,
                prompt_token_ids=state.prompt_token_ids,
                output_token_ids=outputs,
                eos_token_ids=state.eos_token_ids,
            )
        )
    return states


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a row emits: the drafts that match the tokens `sampled` at their positions
    (len(drafts) + 1 of them), up to the first that does not, then the sampled token there."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens")
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == sampled[num_accepted]:
        num_accepted += 1
    return list(sampled[: num_accepted + 1])
