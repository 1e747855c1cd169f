"""Set-up shared by the processes the engine spawns (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def hide_checkout_kernels() -> None:
    """Drop sys.path entries that expose this repository's `kernels/` as a top-level package.

    Run from a checkout (tests, benchmarks), the repository root is on sys.path, so
    `import kernels` finds our folder, which ships as `asyncengine.kernels`. transformers then
    takes it for Hugging Face's `kernels` package: it scans every installed distribution's
    metadata looking for its version (a quarter of a second) and imports our folder under the
    other package's name. Only for processes the engine owns, after their main module loaded.
    """
    import importlib.util

    spec = importlib.util.find_spec("asyncengine.kernels")
    if spec is None or spec.origin is None:
        return
    ours = Path(spec.origin).resolve().parent
    sys.path[:] = [
        entry for entry in sys.path if (Path(entry or os.getcwd()) / "kernels").resolve() != ours
    ]
