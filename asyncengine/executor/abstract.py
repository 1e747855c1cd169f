"""Executor ABC: how the engine core drives its model workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.ipc.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.extension import UnencodableResultError, check_method

FailureCallback = Callable[[], None]
# Computes a step's grammar bitmask (structured outputs) from the grammars' state, which the
# step itself does not change: an executor may run it beside the forward pass.
GrammarFill = Callable[[], "GrammarBitmask | None"]


class Executor(ABC):
    """Runs SchedulerOutputs on the workers and returns rank 0's ModelRunnerOutput.

    When a worker fails outside of a call (it dies, say), the executor calls every registered
    failure callback once; the engine core uses that to poison its input queue.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []
        self.is_failed = False
        self.failure_reason: str | None = None
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model."""

    @classmethod
    def import_model_code(cls, config: EngineConfig, *, owns_process: bool) -> None:
        """Import, before the executor is built, the model code it will run in the calling
        process (`owns_process`: the engine owns that process). None by default: the model
        runs in worker processes, which import it themselves."""
        return None

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

    def call_extension(
        self,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> list[Any]:
        """The public collective_rpc: a worker extension's `method` on every worker (see
        EngineCore.collective_rpc for the errors); the engine's own methods are refused."""
        check_method(self.config.parallel_config.worker_extension_cls, method)
        try:
            return self.collective_rpc(
                "call_extension", args=(method, args, kwargs), timeout=timeout
            )
        except TimeoutError:
            raise
        except Exception as exc:
            # From a worker process, the error arrives as text (WorkerError).
            if isinstance(exc, UnencodableResultError) or UnencodableResultError.__name__ in str(
                exc
            ):
                raise TypeError(
                    f"collective_rpc({method!r}): a worker returned a result msgspec cannot "
                    "encode (return plain data: None, bool, int, float, str, bytes, lists, "
                    "dicts, msgspec Structs)"
                ) from exc
            raise RuntimeError(f"collective_rpc({method!r}) failed in a worker: {exc}") from exc

    # True: execute_model runs a grammar fill beside the forward pass (the scheduler then
    # leaves it to the executor); False: the scheduler fills the bitmask itself.
    overlaps_grammar_fill: bool = False

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_fill: GrammarFill | None = None
    ) -> ModelRunnerOutput:
        """Run one step on every worker; rank 0's output. `grammar_fill`, when given (only to
        an executor that `overlaps_grammar_fill`), gives the bitmask the sampler must apply."""

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
