"""UniProcExecutor: the single worker lives in the engine core's own process (or thread)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.executor.abstract import Executor, GrammarFill
from asyncengine.executor.placement import worker_device
from asyncengine.ipc.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.extension import with_extension
from asyncengine.worker.worker import Worker


class UniProcExecutor(Executor):
    @classmethod
    def import_model_code(cls, config: EngineConfig, *, owns_process: bool) -> None:
        from asyncengine.model.loader import import_model_code

        # The worker runs in this process: see import_model_code for what `freeze` does.
        import_model_code(config.model_config, freeze=owns_process)
        parallel = config.parallel_config
        if owns_process and (parallel.num_threads is not None or parallel.workers_per_machine > 1):
            import torch

            # Data-parallel ranks on one machine share its cores: more threads only contend.
            torch.set_num_threads(parallel.threads_per_worker())

    # The grammar bitmask is filled on a thread of its own while the model runs: on CPUs the
    # forward pass leaves a core idle for much of its Python and single-threaded parts.
    overlaps_grammar_fill = True

    def _init_executor(self) -> None:
        self._fill_thread: ThreadPoolExecutor | None = None
        c = self.config
        # The core's one worker: cuda:0 of the GPUs this core sees (executor/placement.py).
        device = worker_device(c.device_config.device, 0)
        # With a worker_extension_cls, its methods mixed in (collective_rpc calls them).
        worker_cls = with_extension(Worker, c.parallel_config.worker_extension_cls)
        self.worker: Worker = worker_cls(
            c.model_config,
            c.cache_config,
            c.device_config,
            device=device,
            scheduler_config=c.scheduler_config,
        )
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

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_fill: GrammarFill | None = None
    ) -> ModelRunnerOutput:
        if grammar_fill is None:
            return self.worker.execute_model(scheduler_output)
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-fill")
        bitmask = self._fill_thread.submit(grammar_fill)
        return self.worker.execute_model(scheduler_output, bitmask.result)

    def shutdown(self) -> None:
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
        self.worker.shutdown()
