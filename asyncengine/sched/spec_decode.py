"""Speculative decoding's scheduler side: n-gram drafts in, accepted tokens out, KV rolled back.

A decoding request (its last token not yet computed) gets up to `num_speculative_tokens`
draft tokens from `ngram_proposer.propose` over its own prompt and output. The step schedules
its last token and the drafts, 1 + len(drafts) positions, like a short prefill chunk; the
runner verifies the drafts (worker/rejection_sampler.py) and returns the accepted ones plus
one token of the model's own. Then `rollback` puts the request back where the accepted tokens
leave it: its computed count drops by the rejected drafts, and the KV blocks past it (which
hold only rejected drafts' K/V) go back to the pool.

The prefix cache never sees a draft: blocks are hashed from the request's own tokens (drafts
are not among them until accepted), and only blocks full of them.

Turn-down, engine-wide: a step drafts only while its decode rows and drafts together stay
within `MAX_STEP_TOKENS`; past that, each extra row costs real time (measured: see the
constant), so a large batch decodes plainly. The step's drafts are shared out evenly: the
first drafts of a request are the likeliest to be accepted.

Turn-down, per request: a request whose last `WINDOW_TOKENS` drafts were accepted less than
`MIN_ACCEPTANCE` of the time stops drafting for its next `PAUSE_STEPS` decode steps (each
drafted step computes 1 + k positions, which costs time in a batch; and the proposer's search
is skipped too), then tries again. Each window in a row that fails doubles the pause, up to
`MAX_PAUSE_STEPS`; a window that passes resets it. Output that does not repeat its input soon
drafts only one step in ~20, while a task that copies its input between edits (a renamed
variable, a corrected word) is back to drafting a few tokens after each edit: with a fixed
32-step pause, SmolLM2's rename task ran at 2.2x plain, with the doubling 3.1x.

Not speculated (they decode one token a step, as without speculation):
- structured outputs: drafts are not checked against the grammar (issue 36 allows this);
- embedding requests, which never decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.config import SpeculativeConfig
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.ngram_proposer import propose
from asyncengine.sched.request import Request

# Measured on SmolLM2-135M, bf16, 2 shared Zen cores (benchmarks/speculative.py, 2026-11-27):
# a step of 4 decode rows took ~1.5x one of 1 row, 8 rows ~2x; at 16 streams, k = 4 drafts
# each (80 rows) ran at 0.90x without a cap.
MAX_STEP_TOKENS = 8
WINDOW_TOKENS = 16
MIN_ACCEPTANCE = 0.25
# The first pause, and the most a run of failing windows grows it to (see the docstring).
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 64


@dataclass(slots=True)
class _Window:
    """One request's drafts since its window began, and the decode steps it still sits out."""

    drafted: int = 0
    accepted: int = 0
    paused_steps: int = 0
    strikes: int = 0  # windows in a row that ended in a pause


@dataclass(slots=True)
class NgramSpeculator:
    """Drafts for the scheduler's decoding requests, and the counts `statistics()` reports."""

    config: SpeculativeConfig
    num_draft_tokens: int = 0  # drafted and verified, in all
    num_accepted_tokens: int = 0
    # Per draft position (0 = first draft token): how often one was drafted, and accepted.
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_turn_downs: int = 0  # windows after which a request stopped drafting for a while
    _windows: dict[str, _Window] = field(default_factory=dict)  # by request id
    _step_room: int = 0  # drafts the current step may still take (begin_step)
    _step_share: int = 0  # the most one request may take of them

    def __post_init__(self) -> None:
        k = self.config.num_speculative_tokens
        self.drafted_per_position = [0] * k
        self.accepted_per_position = [0] * k

    def begin_step(self, num_running: int) -> None:
        """A step with `num_running` requests running begins: it may draft up to
        `MAX_STEP_TOKENS` - `num_running` tokens in all, an even share of them each."""
        self._step_room = MAX_STEP_TOKENS - num_running
        self._step_share = -(-self._step_room // max(num_running, 1))

    def draft(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Up to `num_speculative_tokens` drafts for `request`, when it decodes this step;
        [] when it may not speculate (see the module docstring) or has no room: the step's
        token `budget` counts its own token too, every draft needs a position below
        `max_model_len`, and the step emits up to 1 + len(drafts) of its `max_tokens`."""
        if request.num_computed_tokens != request.num_tokens - 1 or not _may_speculate(request):
            return []
        window = self._windows.get(request.request_id)
        if window is not None and window.paused_steps > 0:
            window.paused_steps -= 1
            return []
        room = min(
            self.config.num_speculative_tokens,
            self._step_room,
            self._step_share,
            budget - 1,
            max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        )
        if room <= 0:
            return []
        cfg = self.config
        drafts = propose(request.all_token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self._step_room -= len(drafts)
        return drafts

    def rollback(
        self,
        request: Request,
        num_drafts: int,
        num_emitted: int,
        kv_cache_manager: KVCacheManager,
    ) -> None:
        """After a step that verified `num_drafts` drafts of `request` and emitted
        `num_emitted` tokens (the accepted drafts and one more), before they are appended:
        forget the rejected drafts' positions and free the blocks only they used."""
        num_accepted = max(0, min(num_emitted - 1, num_drafts))
        request.num_computed_tokens -= num_drafts - num_accepted
        kv_cache_manager.free_tail(request)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        window = self._windows.setdefault(request.request_id, _Window())
        window.drafted += num_drafts
        window.accepted += num_accepted
        if window.drafted >= WINDOW_TOKENS:
            if window.accepted < MIN_ACCEPTANCE * window.drafted:
                window.paused_steps = min(PAUSE_STEPS << window.strikes, MAX_PAUSE_STEPS)
                window.strikes += 1
                self.num_turn_downs += 1
            else:
                window.strikes = 0
            window.drafted = window.accepted = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's window."""
        self._windows.pop(request_id, None)


def _may_speculate(request: Request) -> bool:
    return request.grammar is None and request.pooling is None
