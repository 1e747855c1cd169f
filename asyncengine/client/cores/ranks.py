"""RankBook: what ProcCoreClient keeps per rank: where each message goes, and what each
rank's outputs mean to AsyncLLM.

One core (SingleRank, here) needs no book-keeping: everything goes to it and comes back as
it is. Several (DataParallelRanks, dp_ranks.py) consult the router, combine utility results,
and turn one rank's death into RankDied while the others serve on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from asyncengine.client.cores.client import RankDied
from asyncengine.ipc.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall


class RankBook(ABC):
    """Routing and output book-keeping over the ranks; no IO."""

    engine_dead: str | None = None  # set when the engine as a whole is dead, with why

    @abstractmethod
    def route(self, request: EngineCoreRequest, data_parallel_rank: int | None) -> int:
        """The rank `request` goes to (`data_parallel_rank` when given)."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ranks holding `request_ids`, with theirs."""

    @abstractmethod
    def call(self, call: UtilityCall) -> list[int]:
        """The ranks a utility call goes to (its one result comes back through `take`)."""

    @abstractmethod
    def take(self, rank: int, outputs: EngineCoreOutputs) -> list[EngineCoreOutputs | RankDied]:
        """One message from live rank `rank` (its death, if `engine_dead` is set): what to
        pass on to AsyncLLM."""

    @abstractmethod
    def is_live(self, rank: int) -> bool: ...

    def rank_errors(self) -> dict[int, str]:
        """Data-parallel ranks that died, with why, while the engine serves on."""
        return {}


class SingleRank(RankBook):
    """One core: every message goes to it, every output comes back as it is."""

    def route(self, request: EngineCoreRequest, data_parallel_rank: int | None) -> int:
        return 0

    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        return {0: request_ids} if request_ids else {}

    def call(self, call: UtilityCall) -> list[int]:
        return [0]

    def take(self, rank: int, outputs: EngineCoreOutputs) -> list[EngineCoreOutputs | RankDied]:
        if outputs.engine_dead is not None:
            self.engine_dead = outputs.engine_dead
        return [outputs]

    def is_live(self, rank: int) -> bool:
        return rank == 0 and self.engine_dead is None
