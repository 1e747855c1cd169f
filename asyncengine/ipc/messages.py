"""Wire types between the client and the engine core.

Pipeline: EngineCoreRequest → (core) → EngineCoreOutputs → OutputProcessor → RequestOutput.
Every message is a `msgspec.Struct` (array_like for compact frames, gc=False because they hold
no cycles); they are decoded with typed decoders, never pickled.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Any

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.sampling_params import CoreSamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client

    def __str__(self) -> str:
        return self.name.lower()


# EngineCoreRequest.pooling: None (generate), or how an embedding request pools.
POOLING_TYPES: tuple[str | None, ...] = (None, "last", "mean", "cls")


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenised request, as the core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: CoreSamplingParams  # a SamplingParams, validated by the client
    arrival_time: float
    priority: int = 0
    # Which of the core's clients sent it (API server processes share the cores): its
    # outputs go back to that client's output socket.
    client_index: int = 0
    # An embedding request (AsyncLLM.embed): how to pool the prompt's final hidden states
    # ("last", "mean" or "cls"). It is prefilled, never decoded, and finishes with `pooled`.
    pooling: str | None = None
    # The LoRA adapter it runs with (a name the core holds: AsyncLLM.add_lora); None: the base.
    lora_name: str | None = None


# One sampled position's logprobs: token ids (sampled first, then the top-N), their logprobs,
# and the sampled token's rank in the distribution (1 = most likely).
LogprobsEntry = tuple[list[int], list[float], int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    # Prompt logprobs computed this step: (the prompt position of the first entry, entries),
    # the token at each position given the tokens before it ("sampled" = the prompt's token).
    new_prompt_logprobs: tuple[int, list[LogprobsEntry]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # this request failed in the core (it is finished, with ABORT)
    bad_request: bool = False  # the error is the request's own (the client raises ValueError)
    pooled: list[float] | None = None  # an embedding request's pooled hidden state (fp32)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call of one of the core's utility methods (health check, stats, ...) by name."""

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0  # where the UtilityResult goes


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a UtilityCall: its result, or the error it raised (as text)."""

    call_id: int
    result: Any = None
    error: str | None = None


class CoreLoad(msgspec.Struct, array_like=True, gc=False):
    """A core's load, published with its outputs (the data-parallel router reads it)."""

    num_waiting_reqs: int
    num_running_reqs: int
    kv_cache_usage: float  # 0..1


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Every request's new tokens of one step, in one message.

    The same message carries a utility call's answer, and ENGINE_CORE_DEAD: `engine_dead`
    holds the reason when the core is about to exit after a fatal error. `engine_index` is
    the sending core's data-parallel rank; `load` its load after the step (or at a
    heartbeat), when it has one to report.
    """

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    utility_output: UtilityResult | None = None
    engine_dead: str | None = None
    engine_index: int = 0
    load: CoreLoad | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A snapshot of the engine core: queues, KV blocks and prefix-cache hits."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_preemptions: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float  # fraction of the KV blocks in use, 0..1
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_prefill_tokens: int = 0  # prompt (and recompute) tokens the model has computed
    # Speculative decoding (docs/speculative.md): draft tokens verified, and how many of them
    # the model accepted (each step also emits one token of its own per drafted request).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_turn_downs: int = 0  # times a request's failing drafts paused its drafting
    # Per draft position (0: a step's first draft): drafts verified there, and accepted.
    spec_drafts_per_position: tuple[int, ...] = ()
    spec_accepted_per_position: tuple[int, ...] = ()
    # With data parallel: the total above, and here each live rank's own snapshot (by rank).
    ranks: tuple[EngineStats, ...] = ()
    data_parallel_rank: int | None = None  # set on a rank's own snapshot

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def spec_acceptance_rate(self) -> float:
        """The fraction of draft tokens accepted (0.0 with none drafted)."""
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @classmethod
    def total(cls, ranks: list[EngineStats]) -> EngineStats:
        """The sum of the ranks' snapshots (KV usage over all their blocks), with `ranks`."""
        num_blocks = sum(r.num_kv_blocks for r in ranks)
        free = sum(r.num_free_kv_blocks for r in ranks)
        return cls(
            num_running_reqs=sum(r.num_running_reqs for r in ranks),
            num_waiting_reqs=sum(r.num_waiting_reqs for r in ranks),
            num_preemptions=sum(r.num_preemptions for r in ranks),
            num_kv_blocks=num_blocks,
            num_free_kv_blocks=free,
            kv_cache_usage=(num_blocks - free) / num_blocks if num_blocks else 0.0,
            prefix_cache_queries=sum(r.prefix_cache_queries for r in ranks),
            prefix_cache_hits=sum(r.prefix_cache_hits for r in ranks),
            num_prefill_tokens=sum(r.num_prefill_tokens for r in ranks),
            num_draft_tokens=sum(r.num_draft_tokens for r in ranks),
            num_accepted_tokens=sum(r.num_accepted_tokens for r in ranks),
            num_spec_turn_downs=sum(r.num_spec_turn_downs for r in ranks),
            spec_drafts_per_position=_add_up(r.spec_drafts_per_position for r in ranks),
            spec_accepted_per_position=_add_up(r.spec_accepted_per_position for r in ranks),
            ranks=tuple(ranks),
        )


def _add_up(rows: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """Element-wise sums of tuples (of any lengths)."""
    return tuple(sum(column) for column in itertools.zip_longest(*rows, fillvalue=0))


# ---- input frames: [request type (one byte), payload] -----------------------------------------


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every client → core message."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of core request ids
    UTILITY = b"\x02"  # payload: UtilityCall
    # Only inside the core: the executor's failure callback puts it on the input queue.
    EXECUTOR_FAILED = b"\x03"


# ---- startup: the launch arguments (on the core's stdin), then a handshake over a ROUTER
# socket bound by the client and a DEALER in the core ------------------------------------------


class EngineCoreLaunch(msgspec.Struct, gc=False):
    """Client → core process, on its stdin at start: its config and where to say HELLO."""

    config: EngineConfig
    handshake_address: str
    # A terminal's Ctrl-C reaches every process of the job: the core leaves it to its owner
    # (AsyncLLM, `serve`, the API server manager), which drains first and then stops it. The
    # process launcher sets it (CoreProcess defaults to True); False only where a test wants
    # the core to act on SIGINT itself.
    ignore_sigint: bool = False


class HandshakeHello(msgspec.Struct, tag=True, gc=False):
    """Core → client, first thing after the process starts: it is alive."""

    pid: int


class HandshakeAddresses(msgspec.Struct, tag=True, gc=False):
    """Client → core: where to bind the request (input) socket, and the output socket of
    each client (index = client_index; API server processes are several clients)."""

    input_address: str
    output_addresses: list[str]


class HandshakeReady(msgspec.Struct, tag=True, gc=False):
    """Core → client: the model is loaded and the KV cache allocated; serving starts."""

    num_kv_blocks: int
    input_address: str = ""  # the input socket it bound (its port, when told `*`)


class HandshakeFailed(msgspec.Struct, tag=True, gc=False):
    """Core → client: start-up failed; `error` is the root cause, as text."""

    error: str


HandshakeMessage = HandshakeHello | HandshakeAddresses | HandshakeReady | HandshakeFailed
