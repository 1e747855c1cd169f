"""EngineCoreClient: how AsyncLLM reaches its engine core, in other processes or a thread.

- ProcCoreClient (proc_client.py): N >= 1 engine cores (data-parallel ranks), each a
  CoreHandle (a process of its own, a Ray actor's, or one another process started), over ZMQ.
- ThreadCoreClient (thread_client.py): the busy loop in a background thread, no sockets.

Methods named `*_nowait` never block and may be called from the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from asyncengine.ipc.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall

# The core sends something at least every HEARTBEAT_INTERVAL_S (0.5 s); silent this long, it
# is stopped or hung: health checks fail at once. Silent past its step_timeout, it is dead.
UNRESPONSIVE_AFTER_S = 3.0
MAX_OUTPUTS_PER_BATCH = 64  # messages taken per get_outputs(), to keep the loop responsive


@dataclass(frozen=True, slots=True)
class RankDied:
    """Among the outputs: one data-parallel rank is gone while others serve on.

    `request_ids` are the core request ids that were on it: their streams end with
    EngineDeadError. (When the last rank goes, or with data_parallel_fail_fast, the engine
    as a whole is dead instead: `wait_dead()` returns.)
    """

    rank: int
    reason: str
    request_ids: list[str]


class EngineCoreClient(ABC):
    """The client's end of the engine core (or of several, with data parallel)."""

    num_kv_blocks: int = 0  # known once the core is ready (the sum over the ranks)

    async def launch(self) -> None:
        """Set the core's start-up going without waiting for it; `start()` then waits.

        Optional (`start()` launches a core not yet launched): it lets the caller do its own
        start-up work while the core starts. A no-op where the core cannot start on its own.
        """
        return None

    @abstractmethod
    async def start(self) -> None:
        """Start the core and wait until it serves; EngineStartupError with the root cause."""

    @abstractmethod
    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request; with data parallel, to `data_parallel_rank` or where the router
        says (the n > 1 copies of one request, `id#i`, go where their first went)."""

    @abstractmethod
    def abort_requests_nowait(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def call_utility_nowait(self, call: UtilityCall) -> None:
        """Send a utility call; its UtilityResult arrives among the outputs (with data
        parallel: one result, combining every live rank's)."""

    @abstractmethod
    async def get_outputs(self) -> list[EngineCoreOutputs | RankDied]:
        """Wait for outputs from the core and return every message that has arrived."""

    @abstractmethod
    async def wait_dead(self) -> str:
        """Return, with a reason, when the core has died by itself (never on shutdown()),
        or has been silent past its step_timeout (it is then killed). With data parallel:
        when no rank is left (or one died, with data_parallel_fail_fast)."""

    def silent_for(self) -> float:
        """Seconds since the core was last heard from (0 where it cannot be silent)."""
        return 0.0

    def rank_errors(self) -> dict[int, str]:
        """Data-parallel ranks that died, with why (the engine serves on the others)."""
        return {}

    @property
    def data_parallel_size(self) -> int:
        return 1

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core and join every thread and process; idempotent, cancel-safe."""
