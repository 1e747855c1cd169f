"""Choose the executor class for a config."""

from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    """`distributed_executor_backend`: "uni" runs the worker in the engine core, "mp" one
    process per tensor-parallel rank (the config resolves the default from the TP size)."""
    if config.parallel_config.distributed_executor_backend == "mp":
        from asyncengine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    from asyncengine.executor.uniproc import UniProcExecutor

    return UniProcExecutor
