"""asyncengine: an embeddable, asyncio-first LLM inference engine.

Importing it loads no torch: the heavy parts are imported when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineGenerateError,
    EngineOverloadedError,
    EngineStartupError,
    InvalidRequestError,
    UnsupportedModelError,
)
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncengine.version import __version__

if TYPE_CHECKING:
    from asyncengine.client.async_llm import AsyncLLM
    from asyncengine.config import EngineConfig
    from asyncengine.entrypoints.llm import LLM
    from asyncengine.ipc.messages import EngineStats


__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineGenerateError",
    "EngineOverloadedError",
    "EngineStartupError",
    "EngineStats",
    "InvalidRequestError",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedModelError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import asyncengine` stays light (the LLM class pulls in the tokenizer).
    if name == "LLM":
        from asyncengine.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        # Client side only: no torch (the engine core is imported in its own process).
        from asyncengine.client.async_llm import AsyncLLM

        return AsyncLLM
    if name == "EngineStats":
        from asyncengine.ipc.messages import EngineStats

        return EngineStats
    if name == "EngineConfig":
        from asyncengine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public names only: not the typing helpers, nor the submodules imported above.
    return sorted(__all__)
