"""Fault injection for tests: failures of the model runner, the executor and workers, on
demand, in a real engine.

The engine's processes load these when `$ASYNCENGINE_TEST_HOOKS` names this module (set it
before the engine starts: spawned processes inherit it), and refuse every `testing_*` call
otherwise. Call them as utility methods of the core (`UtilityCall(id, "testing_...")`), or as
worker methods through `testing_collective_rpc`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from asyncengine.process_setup import TEST_HOOKS_ENV

if TYPE_CHECKING:
    from asyncengine.core.engine_core import EngineCore
    from asyncengine.worker.worker import Worker

__all__ = ["CORE_HOOKS", "ENV", "TEST_HOOKS_ENV", "WORKER_HOOKS"]


# ---- in the engine core: the first argument is its EngineCore -------------------------------


def _core_fail_next_step(core: EngineCore) -> None:
    """The next execute_model raises, as a crashing model runner would."""
    executor = core.executor
    original = executor.execute_model

    def failing(*args: Any, **kwargs: Any) -> Any:
        executor.execute_model = original  # type: ignore[method-assign]
        raise RuntimeError("injected model runner failure (test hook)")

    executor.execute_model = failing  # type: ignore[method-assign]


def _core_hang_next_step(core: EngineCore, seconds: float) -> None:
    """The next execute_model blocks for `seconds` first, as a hung kernel would."""
    executor = core.executor
    original = executor.execute_model

    def hanging(*args: Any, **kwargs: Any) -> Any:
        executor.execute_model = original  # type: ignore[method-assign]
        time.sleep(seconds)
        return original(*args, **kwargs)

    executor.execute_model = hanging  # type: ignore[method-assign]


def _core_delay_steps(core: EngineCore, seconds: float) -> None:
    """Every execute_model from now on first sleeps `seconds` (0: no more), so a test can act
    between steps of a tiny model."""
    executor = core.executor
    original = getattr(executor, "_testing_undelayed", None) or executor.execute_model
    if seconds <= 0:
        executor.execute_model = original  # type: ignore[method-assign]
        return

    def delayed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    executor._testing_undelayed = original  # type: ignore[attr-defined]
    executor.execute_model = delayed  # type: ignore[method-assign]


def _core_nan_logits(core: EngineCore, request_id: str) -> None:
    """The next logits sampled for `request_id` are NaN, as a model that breaks on one input
    gives (the worker in this process: the "uni" executor only)."""
    runner = core.executor.worker.model_runner  # type: ignore[attr-defined]
    original = runner._sample
    # Until then the model returns logits, never tokens (ModelForward's token_choice).
    runner._token_choice = lambda *args: None

    def poisoned(scheduler_output: Any, req_ids: list[str], logits: Any, *args: Any) -> Any:
        if request_id in req_ids:
            runner._sample = original
            del runner._token_choice
            logits[req_ids.index(request_id)] = float("nan")
        return original(scheduler_output, req_ids, logits, *args)

    runner._sample = poisoned


def _core_collective_rpc(core: EngineCore, method: str, *args: Any) -> list[Any]:
    """Call a worker method on every rank (e.g. a worker's own fault injection below)."""
    return core.executor.collective_rpc(method, args=args, timeout=30.0)


def _core_notify_executor_failure(core: EngineCore) -> None:
    """The executor reports a worker failure through its failure callbacks."""
    core.executor._notify_failure()


CORE_HOOKS = {
    "testing_fail_next_step": _core_fail_next_step,
    "testing_hang_next_step": _core_hang_next_step,
    "testing_delay_steps": _core_delay_steps,
    "testing_nan_logits": _core_nan_logits,
    "testing_collective_rpc": _core_collective_rpc,
    "testing_notify_executor_failure": _core_notify_executor_failure,
}


# ---- in a worker: the first argument is its Worker --------------------------------------------


def _worker_fail_next_step(worker: Worker, rank: int) -> None:
    """The next execute_model on `rank` raises, as a crashing model would."""
    if rank != worker.rank:
        return
    original = worker.execute_model

    def failing(*args: Any, **kwargs: Any) -> Any:
        worker.execute_model = original  # type: ignore[method-assign]
        raise RuntimeError(f"injected failure in worker rank {worker.rank} (test hook)")

    worker.execute_model = failing  # type: ignore[method-assign]


def _worker_sleep(worker: Worker, seconds: float) -> None:
    """Block this worker, as a hung one would (for collective_rpc timeouts)."""
    time.sleep(seconds)


WORKER_HOOKS = {
    "testing_fail_next_step": _worker_fail_next_step,
    "testing_sleep": _worker_sleep,
}

# `monkeypatch.setenv(*ENV)`: enable these hooks in engines started afterwards.
ENV = (TEST_HOOKS_ENV, __name__)
