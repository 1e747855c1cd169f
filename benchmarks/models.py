"""The benchmark models, built once into `.bench/` at the repository root (git-ignored).

- `a`: a random Llama, hidden 256, 4 layers, 8/4 heads, vocab 32000 (~20M parameters).
- `b`: SmolLM2-135M-Instruct, the engine's embedded default model (converted by
  `asyncengine.entrypoints.default_model`, which keeps it in its own cache).
- `c`: a random Llama, hidden 1024, 8 layers, 16/8 heads, vocab 49152 with SmolLM2's
  tokenizer (~225M parameters); built only when asked for. (Until 2026-11-26 it had vocab
  32000 and the test models' word-level tokenizer, which llama.cpp's GGUF converter refuses:
  figures of c from before then are of that smaller model.)
- `d`: a random Qwen2 with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14/2 heads, MLP
  4864, vocab 151936, tied embeddings, q/k/v biases; ~0.5B parameters) and SmolLM2's
  tokenizer (49152 ids: the model's vocabulary is padded, as real checkpoints' often are,
  and the tokenizer can spell JSON); built only when asked for.
- `e`: a random Llama with Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32/8 heads, MLP
  8192, vocab 128256, tied embeddings, rope theta 500000; ~1.24B parameters) and SmolLM2's
  tokenizer (vocabulary padded, as d's); built only when asked for. The quantized runs
  (`python -m benchmarks.peers --quant ...`) use GGUF files of it made by llama.cpp's tools.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".bench"
MODEL_NAMES = ("a", "b", "c", "d", "e")

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
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
    # Llama-3.2-1B's shapes (without its llama3 rope scaling: the lengths run here are short)
    "e": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}
# Qwen2.5-0.5B's shapes (model d; benchmarks/gpu_engine.py builds them too).
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
_SEED = 0
# The models that take SmolLM2's tokenizer in place of the tiny word-level one (which llama.cpp's
# converter cannot name a pre-tokenizer for).
_SMOLLM2_TOKENIZER = ("c", "e")
_MARKER = "bench-model.json"  # written last: its presence means the folder is complete


class ModelUnavailable(RuntimeError):
    """The model cannot be built or found here (e.g. a missing optional package)."""


def describe(name: str) -> str:
    if name == "b":
        return "SmolLM2-135M-Instruct"
    if name == "d":
        return "random-qwen2 h896 L24 14/2h vocab 151936 (Qwen2.5-0.5B shapes)"
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
    if name == "d":
        return _random_qwen2_05b(cache_dir)
    if name not in _RANDOM_LLAMAS:
        raise ValueError(f"unknown benchmark model {name!r}: one of {', '.join(MODEL_NAMES)}")
    return _random_llama(name, cache_dir)


def _random_llama(name: str, cache_dir: Path) -> Path:
    overrides = _RANDOM_LLAMAS[name]
    target = cache_dir / f"model-{name}"
    spec = {"arch": "llama", "seed": _SEED, "dtype": "bfloat16", **overrides}
    if name in _SMOLLM2_TOKENIZER:
        spec["tok"] = "smollm2"
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return target
    from asyncengine.testing.models import build_tiny_model

    tokenizer_dir = _default_model() if name in _SMOLLM2_TOKENIZER else None
    print(f"building benchmark model {name} ({describe(name)}) in {target} ...", file=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    build_tiny_model(target, "llama", seed=_SEED, dtype="bfloat16", **overrides)
    if tokenizer_dir is not None:
        _use_tokenizer_of(tokenizer_dir, target)
    marker.write_text(json.dumps(spec))
    return target


def _random_qwen2_05b(cache_dir: Path) -> Path:
    target = cache_dir / "model-d"
    spec = {"arch": "qwen2", "seed": _SEED, "dtype": "bfloat16", **QWEN2_05B, "tok": "smollm2"}
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return target
    from asyncengine.testing.models import build_tiny_model

    tokenizer_dir = _default_model()
    print(f"building benchmark model d ({describe('d')}) in {target} ...", file=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    build_tiny_model(target, "qwen2", seed=_SEED, dtype="bfloat16", **QWEN2_05B)
    _use_tokenizer_of(tokenizer_dir, target)
    marker.write_text(json.dumps(spec))
    return target


def _use_tokenizer_of(tokenizer_dir: Path, target: Path) -> None:
    """SmolLM2's tokenizer (from `tokenizer_dir`) and its special ids in place of the tiny
    word-level one in the model folder `target`."""
    for stale in target.glob("*token*"):
        stale.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    smol = json.loads((tokenizer_dir / "config.json").read_text())
    config = json.loads((target / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = smol.get(key)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").unlink(missing_ok=True)


def _default_model() -> Path:
    try:
        from asyncengine.default_model import default_model_dir
    except ImportError as exc:
        raise ModelUnavailable(f"asyncengine.default_model is not importable: {exc}") from exc
    try:
        return default_model_dir()
    except Exception as exc:  # a missing package, a failed conversion: skip, don't crash
        raise ModelUnavailable(f"default model unavailable: {type(exc).__name__}: {exc}") from exc
