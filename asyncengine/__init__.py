"""asyncengine: an embeddable, asyncio-first LLM inference engine.

Importing it loads no torch: the heavy parts are imported when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import EngineDeadError, EngineStartupError, UnsupportedModelError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig
    from asyncengine.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStartupError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "UnsupportedModelError",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import asyncengine` stays light (the LLM class pulls in the tokenizer).
    if name == "LLM":
        from asyncengine.entrypoints.llm import LLM

        return LLM
    if name == "EngineConfig":
        from asyncengine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")
