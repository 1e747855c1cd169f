"""Choose the executor class for a config."""

from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    from asyncengine.executor.uniproc import UniProcExecutor

    return UniProcExecutor
