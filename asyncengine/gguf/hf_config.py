"""A Hugging Face config.json dict from a GGUF file's metadata.

A GGUF file has no config.json: llama.cpp keeps the shapes under `<arch>.<key>` metadata. The
keys and their HF names are the ones transformers' GGUF loader uses (GGUF_CONFIG_MAPPING in
transformers.integrations.ggml), so the dict equals the config transformers builds from the same
file, with two differences, both where transformers falls back on a config class default:
`head_dim` also comes from `attention.key_length` (transformers reads it for llama/mistral from
`rope.dimension_count` only, and Qwen3Config's default 128 is wrong for some Qwen3 shapes), and
`rope_scaling` is read from `rope.scaling.*` (transformers reads it for gpt-oss only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from asyncengine.gguf.errors import GGUFError
from asyncengine.gguf.ggml_types import GGMLType

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_HF_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# <arch>.<key> → HF key, as transformers maps them.
_SHAPE_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_REQUIRED = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
# tokenizer.ggml.<key> → HF key.
_TOKEN_ID_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}


def gguf_architecture(path: str | os.PathLike[str], metadata: dict[str, Any]) -> str:
    """`general.architecture`, checked to be one asyncengine runs."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(path, "the metadata has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            path,
            f"architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return arch


def hf_config(
    path: str | os.PathLike[str], metadata: dict[str, Any], tensor_types: Mapping[str, int]
) -> dict[str, Any]:
    """The config.json dict of the model in a GGUF file (see the module docstring).

    `tensor_types` maps the file's GGUF tensor names to their ggml types (a file without
    `output.weight` ties its lm_head to the embeddings). Raises `GGUFError` for a missing or
    malformed shape key."""
    arch = gguf_architecture(path, metadata)
    for key in _REQUIRED:
        if not isinstance(metadata.get(f"{arch}.{key}"), int):
            raise GGUFError(path, f"the metadata lacks {arch}.{key} (an integer)")
    # llama.cpp converts Mistral models as "llama" and runs them as Llama (no sliding window
    # in the metadata); so do we, and so does transformers for any general.name but exactly
    # "mistral". A file that says "mistral" is a MistralForCausalLM.
    mtype = arch
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[mtype]],
        "model_type": mtype,
        "tie_word_embeddings": "output.weight" not in tensor_types,
    }
    for key, hf_key in _SHAPE_KEYS.items():
        if f"{arch}.{key}" in metadata:
            config[hf_key] = metadata[f"{arch}.{key}"]
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if "vocab_size" not in config:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            config["vocab_size"] = len(tokens)
    head_dim = _head_dim(arch, metadata)
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope_scaling = _rope_scaling(arch, metadata)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for key, hf_key in _TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{key}" in metadata:
            config[hf_key] = metadata[f"tokenizer.ggml.{key}"]
    config["torch_dtype"] = _torch_dtype(tensor_types)
    return config


def _head_dim(arch: str, metadata: dict[str, Any]) -> int | None:
    key_length = metadata.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int):
        return key_length
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    if arch in ("llama", "mistral") and isinstance(rope_dims, int):
        return rope_dims  # transformers' reading: llama rotates the whole head
    return None


def _rope_scaling(arch: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """`rope.scaling.type` "linear" or "yarn" with its factor, as HF's legacy rope_scaling.

    Llama 3.1-style scaling is not in the metadata: llama.cpp stores it as the tensor
    `rope_freqs.weight` (per-frequency divisors), which `GGUFModel.extra_tensors` exposes."""
    prefix = f"{arch}.rope.scaling."
    rope_type = metadata.get(prefix + "type")
    if not isinstance(rope_type, str) or rope_type == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    if isinstance(metadata.get(prefix + "factor"), float | int):
        scaling["factor"] = float(metadata[prefix + "factor"])
    if isinstance(metadata.get(prefix + "original_context_length"), int):
        scaling["original_max_position_embeddings"] = metadata[prefix + "original_context_length"]
    return scaling


def _torch_dtype(tensor_types: Mapping[str, int]) -> str:
    """The dtype to compute in: float32 or float16 for a file of only that type (norms are
    F32 in every file, so they don't count), bfloat16 otherwise (BF16 and quantized files)."""
    types = {t for name, t in tensor_types.items() if not name.endswith("norm.weight")}
    if types <= {GGMLType.F32}:
        return "float32"
    if types <= {GGMLType.F32, GGMLType.F16}:
        return "float16"
    return "bfloat16"
