"""The benchmark models, built once into `.bench/` at the repository root (git-ignored).

- `a`: a random Llama, hidden 256, 4 layers, 8/4 heads, vocab 32000 (~20M parameters).
- `b`: SmolLM2-135M-Instruct, the engine's embedded default model (converted by
  `asyncengine.entrypoints.default_model`, which keeps it in its own cache).
- `c`: a random Llama, hidden 1024, 8 layers, 16/8 heads, vocab 32000 (~160M parameters);
  built only when asked for.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".bench"
MODEL_NAMES = ("a", "b", "c")

# Overrides of the transformers LlamaConfig (see asyncengine.testing.models).
_RANDOM_LLAMAS: dict[str, dict[str, Any]] = {
    "a": dict(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "c": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
}
_SEED = 0
_MARKER = "bench-model.json"  # written last: its presence means the folder is complete


class ModelUnavailable(RuntimeError):
    """The model cannot be built or found here (e.g. a missing optional package)."""


def describe(name: str) -> str:
    if name == "b":
        return "SmolLM2-135M-Instruct"
    cfg = _RANDOM_LLAMAS[name]
    return (
        f"random-llama h{cfg['hidden_size']} L{cfg['num_hidden_layers']} "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}h"
    )


def model_dir(name: str, cache_dir: Path = CACHE_DIR) -> Path:
    """The folder of benchmark model `name` (one of MODEL_NAMES), building it on first use.

    Raises ModelUnavailable, with the reason, when it cannot be had on this machine.
    """
    if name == "b":
        return _default_model()
    if name not in _RANDOM_LLAMAS:
        raise ValueError(f"unknown benchmark model {name!r}: one of {', '.join(MODEL_NAMES)}")
    return _random_llama(name, cache_dir)


def _random_llama(name: str, cache_dir: Path) -> Path:
    overrides = _RANDOM_LLAMAS[name]
    target = cache_dir / f"model-{name}"
    spec = {"arch": "llama", "seed": _SEED, "dtype": "bfloat16", **overrides}
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return target
    from asyncengine.testing.models import build_tiny_model

    print(f"building benchmark model {name} ({describe(name)}) in {target} ...", file=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    build_tiny_model(target, "llama", seed=_SEED, dtype="bfloat16", **overrides)
    marker.write_text(json.dumps(spec))
    return target


def _default_model() -> Path:
    try:
        from asyncengine.entrypoints.default_model import default_model_dir
    except ImportError as exc:
        raise ModelUnavailable(
            f"asyncengine.entrypoints.default_model is not importable: {exc}"
        ) from exc
    try:
        return default_model_dir()
    except Exception as exc:  # a missing package, a failed conversion: skip, don't crash
        raise ModelUnavailable(f"default model unavailable: {type(exc).__name__}: {exc}") from exc
