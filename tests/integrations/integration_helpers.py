"""Helpers for the integration tests: the example apps, loaded from docs/examples."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
# Small and fast, with an in-process engine core, on the CPU on any machine.
ENGINE_KW: dict[str, Any] = dict(
    core="thread", device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256, seed=0
)


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
