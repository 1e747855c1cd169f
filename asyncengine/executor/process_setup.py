"""Set-up shared by the processes the engine spawns (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import sys

from asyncengine.config import ModelConfig


def skip_triton_unless_used(model_config: ModelConfig) -> None:
    """Keep this process from importing triton when its attention backend is torch.

    torch's compiler stack imports triton whenever it is installed (transformers imports that
    stack), which costs about 70 MB of resident memory and some start-up time in a process
    that never launches a Triton kernel. Only for processes the engine owns: call it before
    torch is imported. An ImportError for triton is what torch sees without it installed.
    """
    if model_config.attention_backend != "triton" and "triton" not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment]
