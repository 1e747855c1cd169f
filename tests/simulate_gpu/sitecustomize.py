"""A simulated GPU machine, for checking that the test suite does not depend on the machine it
runs on (ASYNCENGINE_TEST_SIMULATE_GPU=1: tests/conftest.py puts this folder first on
PYTHONPATH, so every Python process a test starts imports it at start-up).

device='auto' resolves to "cuda", as on a machine with an NVIDIA GPU (CUDA_VISIBLE_DEVICES ""
or "-1" still hides it). With a CPU build of torch an engine on "cuda" fails at once, so a test
that leaves its device to the machine fails loudly instead of passing here and failing there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PATCHED_MODULE = "asyncengine.config"


def resolve_device(device: str) -> str:
    """asyncengine.config's rule on a machine with a visible NVIDIA GPU."""
    if device != "auto":
        return device
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    return "cuda"


def patch_config(module: ModuleType) -> None:
    if not callable(getattr(module, "resolve_device", None)):
        raise RuntimeError(
            f"{PATCHED_MODULE} has no resolve_device to patch: update tests/simulate_gpu"
        )
    module.resolve_device = resolve_device  # type: ignore[attr-defined]


def _patched_after(execute: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def exec_module(module: ModuleType) -> None:
        execute(module)
        patch_config(module)

    return exec_module


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches asyncengine.config right after it is first executed, so that importing this
    module costs a process nothing (the client must start without torch)."""

    # Marks this finder whatever module name this file was loaded under (sitecustomize at
    # start-up, another when tests/conftest.py loads it by path): one is enough.
    simulates_gpu = True

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != PATCHED_MODULE:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "simulates_gpu", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                loader: Any = spec.loader
                loader.exec_module = _patched_after(loader.exec_module)
                return spec
        return None


def install() -> None:
    loaded = sys.modules.get(PATCHED_MODULE)
    if loaded is not None:
        patch_config(loaded)
    elif not any(getattr(f, "simulates_gpu", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
