"""What a user receives: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Logprob:
    """A token's log-probability at one position, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# token id -> Logprob, for the sampled token and the top-N alternatives at one position
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as its stream reports it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # With SamplingParams(prompt_logprobs=N): one entry per prompt position, None first (the
    # first token has nothing before it); each holds the prompt's token and the top N. In
    # DELTA mode only the first output carries them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # An embedding request's pooled final hidden state (fp32, before `embed()` truncates and
    # normalizes it); None for a generation request.
    embedding: list[float] | None = None


@dataclass(slots=True, frozen=True)
class RankHealth:
    """One data-parallel rank: serving, or dead (and why)."""

    rank: int
    healthy: bool
    error: str | None = None


@dataclass(slots=True, frozen=True)
class EngineHealth:
    """What `AsyncLLM.check_health()` found: every rank's state (one rank without data
    parallel). `degraded`: some rank is dead while others serve."""

    ranks: tuple[RankHealth, ...]

    @property
    def degraded(self) -> bool:
        return any(not r.healthy for r in self.ranks)

    @property
    def status(self) -> str:
        """ "ok" or "degraded" (a dead engine raises instead of reporting)."""
        return "degraded" if self.degraded else "ok"
