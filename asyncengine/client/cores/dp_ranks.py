"""DataParallelRanks: the book-keeping of several engine cores (data-parallel ranks).

The Router (dp_router.py) picks a rank per request from the load each rank publishes with
its outputs; aborts go to the rank that holds the request; a utility call goes to every live
rank and comes back as one result (statistics: the total, with each rank's).

A dead rank is not a dead engine: its requests end with EngineDeadError naming it
(`RankDied` among the outputs), it gets nothing more, and the other ranks serve on. When the
last rank dies, or any with `data_parallel_fail_fast`, the engine is dead as with one core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec

from asyncengine.client.cores.client import RankDied
from asyncengine.client.cores.dp_router import Router
from asyncengine.client.cores.ranks import RankBook
from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingCall:
    method: str
    waiting_for: set[int]
    results: dict[int, UtilityResult] = field(default_factory=dict)


class DataParallelRanks(RankBook):
    """Routes over `size` ranks and keeps what each holds."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.fail_fast = config.parallel_config.data_parallel_fail_fast
        # A rank may be `prefix_margin` load units busier than the least-loaded and still get
        # a request whose prefix it holds: up to a full batch (max_num_seqs) more waiting.
        self.router = Router(
            size,
            config.parallel_config.data_parallel_routing,
            block_size=config.cache_config.block_size,
            prefix_margin=4 * config.scheduler_config.max_num_seqs,
        )
        self._rank_of: dict[str, int] = {}  # core request id → its rank, while live
        self._last_base: tuple[str, int] | None = None  # n > 1 copies follow their first
        self._calls: dict[int, _PendingCall] = {}
        self._dead: dict[int, str] = {}  # rank → why

    def rank_errors(self) -> dict[int, str]:
        return dict(self._dead)

    def is_live(self, rank: int) -> bool:
        return rank in self.router.live

    # ---- requests ------------------------------------------------------------------------

    def route(self, request: EngineCoreRequest, data_parallel_rank: int | None) -> int:
        base = request.request_id.partition("#")[0]
        if data_parallel_rank is not None:
            rank = data_parallel_rank
        elif "#" in request.request_id and self._last_base and self._last_base[0] == base:
            rank = self._last_base[1]  # another copy (`id#i`) of an n > 1 request: its rank
        else:
            rank = self.router.route(request.prompt_token_ids, request.lora_name)
        self._last_base = (base, rank)
        self._rank_of[request.request_id] = rank
        self.router.sent(rank)
        return rank

    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        return by_rank

    def call(self, call: UtilityCall) -> list[int]:
        live = set(self.router.live)
        self._calls[call.call_id] = _PendingCall(call.method, live)
        return sorted(live)

    # ---- outputs -------------------------------------------------------------------------

    def take(self, rank: int, outputs: EngineCoreOutputs) -> list[EngineCoreOutputs | RankDied]:
        if outputs.engine_dead is not None:
            return self._rank_died(rank, outputs.engine_dead)
        if outputs.load is not None:
            self.router.report(rank, outputs.load)
        passed: list[EngineCoreOutputs | RankDied] = []
        if outputs.outputs:
            for output in outputs.outputs:
                if output.finished:
                    self._rank_of.pop(output.request_id, None)
            passed.append(outputs)
        result = outputs.utility_output
        if result is not None:
            combined = self._utility_answered(rank, result)
            if combined is not None:
                passed.append(EngineCoreOutputs(utility_output=combined))
        return passed

    def _utility_answered(self, rank: int, result: UtilityResult) -> UtilityResult | None:
        call = self._calls.get(result.call_id)
        if call is None:
            return None
        call.results[rank] = result
        call.waiting_for.discard(rank)
        return self._finish_call(result.call_id) if not call.waiting_for else None

    def _finish_call(self, call_id: int) -> UtilityResult:
        """Every live rank has answered: one result (the first error, or the combination)."""
        call = self._calls.pop(call_id)
        for rank, result in sorted(call.results.items()):
            if result.error is not None:
                return UtilityResult(call_id, error=f"rank {rank}: {result.error}")
        if not call.results:
            return UtilityResult(call_id, error="no data-parallel rank is alive")
        if call.method == "statistics":
            ranks = [
                msgspec.convert(r.result, EngineStats) for _, r in sorted(call.results.items())
            ]
            return UtilityResult(call_id, result=msgspec.to_builtins(EngineStats.total(ranks)))
        return UtilityResult(call_id, result=call.results[min(call.results)].result)

    def _rank_died(self, rank: int, reason: str) -> list[EngineCoreOutputs | RankDied]:
        reason = (
            reason
            if reason.startswith("engine core rank")
            else f"engine core rank {rank}: {reason}"
        )
        self._dead[rank] = reason
        self.router.remove(rank)
        logger.error("data parallel: %s", reason)
        passed: list[EngineCoreOutputs | RankDied] = []
        # Utility calls waiting on it are answered by the others.
        for call_id, call in list(self._calls.items()):
            call.waiting_for.discard(rank)
            if not call.waiting_for:
                passed.append(EngineCoreOutputs(utility_output=self._finish_call(call_id)))
        lost = [r for r, k in self._rank_of.items() if k == rank]
        for request_id in lost:
            del self._rank_of[request_id]
        if self.fail_fast or not self.router.live:
            why = "data_parallel_fail_fast" if self.router.live else "no rank is left"
            self.engine_dead = f"{reason} ({why})"
            passed.append(EngineCoreOutputs(engine_dead=self.engine_dead))
        else:
            passed.append(RankDied(rank, reason, lost))
        return passed
