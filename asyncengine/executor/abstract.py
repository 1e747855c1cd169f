"""Executor ABC: how the engine core drives its model workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from asyncengine.config import EngineConfig
from asyncengine.sched.output import ModelRunnerOutput, SchedulerOutput

FailureCallback = Callable[[], None]


class Executor(ABC):
    """Runs SchedulerOutputs on the workers and returns rank 0's ModelRunnerOutput.

    When a worker fails outside of a call (it dies, say), the executor calls every registered
    failure callback once; the engine core uses that to poison its input queue.
    """

    max_concurrent_batches: int = 1  # batches in flight at once; >1 needs non_block

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []
        self.is_failed = False
        self.failure_reason: str | None = None
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model."""

    def register_failure_callback(self, callback: FailureCallback) -> None:
        if self.is_failed:
            callback()
        else:
            self._failure_callbacks.append(callback)

    def _notify_failure(self, reason: str = "a worker failed") -> None:
        """Record the failure and call every registered callback, once (thread-safe enough:
        only the first call does anything)."""
        if self.is_failed:
            return
        self.is_failed = True
        self.failure_reason = reason
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            callback()

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; one result per worker, rank order."""

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step; with non_block, return a Future of the result."""

    def determine_num_kv_blocks(self) -> int:
        """The KV block count every worker can hold."""
        return int(min(self.collective_rpc("determine_num_kv_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))

    def check_health(self) -> None:
        """Raise if a worker is unhealthy."""
        self.collective_rpc("check_health")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; idempotent."""
