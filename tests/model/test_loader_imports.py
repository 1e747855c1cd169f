"""Importing the model code at start-up: the GC is back as it was, and a checkout's kernels/
folder is not taken for Hugging Face's `kernels` package (each case in a fresh interpreter,
started from the repository root as the benchmarks and tests are)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc, json, sys
sys.path.insert(0, {root!r})
from asyncengine.config import EngineConfig
from asyncengine.model.loader import import_model_code

config = EngineConfig.from_kwargs({model!r}, device="cpu", num_kv_blocks=8)
# Some installations freeze objects of their own at start-up (a GPU image's site packages
# froze 375): the import's change is what counts.
frozen_before = gc.get_freeze_count()
import_model_code(config.model_config, freeze={freeze})
from transformers.utils.import_utils import is_kernels_available
import asyncengine.kernels  # our kernels still import under their own name

print(json.dumps({{
    "kernels_available": is_kernels_available(),
    "kernels_module": repr(sys.modules.get("kernels", "absent")),
    "gc_enabled": gc.isenabled(),
    "frozen": gc.get_freeze_count() - frozen_before,
}}))
"""


def _run(model: Path, freeze: bool) -> dict[str, object]:
    script = _SCRIPT.format(root=str(REPO_ROOT), model=str(model), freeze=freeze)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("freeze", [True, False])
def test_model_code_import_restores_the_gc_and_ignores_the_checkout_kernels(
    tiny_model_factory: Callable[..., Path], freeze: bool
) -> None:
    # A GELU MLP: not one the lean CPU loader takes, so transformers' model code is imported.
    result = _run(tiny_model_factory("llama", hidden_act="gelu"), freeze)
    assert result["gc_enabled"] is True
    assert result["kernels_available"] is False
    # The checkout's kernels/ was never imported as the top-level `kernels`.
    assert result["kernels_module"] in ("None", "'absent'")
    if freeze:  # an engine-owned process: the imports' objects are out of the GC's way
        assert isinstance(result["frozen"], int) and result["frozen"] > 100_000
    else:  # an application's process: nothing of its heap is pinned
        assert result["frozen"] == 0
