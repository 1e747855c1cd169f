"""Messages between the scheduler and the workers: SchedulerOutput → ModelRunnerOutput.

Both are msgspec Structs so an executor can broadcast them to worker processes cheaply.
SchedulerOutput carries only what the workers need; the workers keep each request's tokens and
block table between steps and receive only what changed.
"""

from __future__ import annotations

import msgspec

from asyncengine.ipc.messages import LogprobsEntry
from asyncengine.sampling_params import CoreSamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers have not seen yet (or are seeing again after a preemption)."""

    request_id: str
    token_ids: list[int]  # the prompt, plus outputs generated before a preemption
    num_prompt_tokens: int
    sampling_params: CoreSamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: these tokens' K/V are already in the cache
    pooling: str | None = None  # an embedding request's pooling (EngineCoreRequest.pooling)
    lora_name: str | None = None  # its LoRA adapter (EngineCoreRequest.lora_name)


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers already hold: its new blocks and where its computation stands."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """The tokens each constrained row may sample this step.

    `bitmask` is int32 [R, W] in C order (R = len(req_ids), W = ceil(V / 32)): bit t % 32 of
    word t // 32 is set when token t is allowed. Rows follow `req_ids`, which name requests
    that sample this step.
    """

    req_ids: list[str]
    bitmask: bytes


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's work: which requests run, and how many tokens of each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # in batch order: cached requests first, then new
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # finished, aborted or preempted since the last step: drop them
    grammar_bitmask: GrammarBitmask | None = None  # None: no row of this step is constrained
    # Speculative decoding: a decoding request's draft tokens, verified this step after its
    # last token (num_scheduled_tokens counts them: 1 + len(drafts)). Absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Sampled in place of a token when a request's logits were NaN (its parameters met the model
# badly, or the model broke on its input): the scheduler ends that request alone, with an error.
INVALID_TOKEN_ID = -1


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """Tokens sampled in one step, one entry per scheduled request, in batch order."""

    req_ids: list[str]
    # Empty for a prefill chunk that did not reach the end; with drafts, the accepted ones
    # and the model's own next token.
    sampled_token_ids: list[list[int]]
    # Per request in batch order: one entry per sampled token; None where none.
    logprobs: list[list[LogprobsEntry] | None] | None = None
    # Per request in batch order: the prompt logprobs this step computed, as
    # (prompt position of the first entry, entries); None where none.
    prompt_logprobs: list[tuple[int, list[LogprobsEntry]] | None] | None = None
    # Per request in batch order: an embedding request's pooled hidden state, in the step
    # that computed its prompt's last token; None elsewhere.
    pooled: list[list[float] | None] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
