"""UniProcExecutor: the single worker lives in the engine core's own process (or thread)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from asyncengine.executor.abstract import Executor
from asyncengine.sched.output import ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        c = self.config
        self.worker = Worker(c.model_config, c.cache_config, c.device_config)
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        # In-process calls cannot time out usefully: the caller's thread is the worker's.
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.execute_model(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def shutdown(self) -> None:
        return None
