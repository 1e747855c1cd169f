"""Reading and checking a PEFT LoRA folder against the base model, without torch.

A PEFT LoRA adapter is a folder with `adapter_config.json` and `adapter_model.safetensors`
(what `PeftModel.save_pretrained` writes). Its tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is
[r, in_features], B is [out_features, r], and the adapted layer computes
`x @ W^T + (x @ A^T @ B^T) * scale`, with `scale = lora_alpha / r` (rsLoRA:
`lora_alpha / sqrt(r)`), as PEFT defines it.

Everything is checked here, from the config and the safetensors header alone (no tensor is
read): the engine core runs it when an adapter is added, so a bad folder is the caller's
ValueError and no worker ever sees it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncengine.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The projections an adapter may target: the lean CPU forward's (model/cpu_forward.py).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$"
)

# adapter_config.json options whose non-default values change what the adapter computes in
# ways the engine does not implement: (key, the values that are fine).
_UNSUPPORTED_OPTIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("use_dora", (None, False)),
    ("bias", (None, "none")),
    ("lora_bias", (None, False)),
    ("fan_in_fan_out", (None, False)),
    ("modules_to_save", (None, [])),
    ("alpha_pattern", (None, {})),
    ("layer_replication", (None, [])),
    ("target_parameters", (None, [])),
)


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted projection: its layer, module name, rank and scale, and tensor names."""

    layer: int
    module: str  # one of TARGET_MODULES
    rank: int
    scale: float
    a_name: str  # the tensor names in adapter_model.safetensors
    b_name: str


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """A checked PEFT LoRA folder: where its weights are, and what they adapt."""

    name: str
    path: str
    weights_file: str
    modules: tuple[LoRAModule, ...]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def check_peft_folder(
    name: str, path: str, model_config: ModelConfig, max_lora_rank: int
) -> PeftAdapter:
    """The adapter in PEFT folder `path`, checked against the base model; ValueError naming
    what is wrong and what is allowed: a missing folder, a folder that is not a PEFT LoRA
    one, an option or module the engine does not run, shapes of another model, a rank above
    `max_lora_rank`."""
    where = f"LoRA adapter {name!r} ({path})"
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder")
    config = _read_config(folder, where)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        other = (
            " (adapter_model.bin is not read: save it with safetensors)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise ValueError(f"{where}: not a PEFT folder: no {ADAPTER_WEIGHTS}{other}")
    shapes = _safetensors_shapes(weights, where)
    modules = _modules(shapes, config, model_config, max_lora_rank, where)
    return PeftAdapter(name, str(folder), str(weights), modules)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{where}: not a PEFT folder: no {ADAPTER_CONFIG}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported: only 'LORA'")
    for key, fine in _UNSUPPORTED_OPTIONS:
        if config.get(key) not in fine:
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported (only {fine[-1]!r})")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha={alpha!r} is invalid: must be a number > 0")
    return config


def _safetensors_shapes(file: Path, where: str) -> dict[str, list[int]]:
    """The tensors' shapes, from the file's JSON header (8-byte little-endian length first)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} is not a safetensors file: {exc}") from None
    shapes: dict[str, list[int]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in ("F32", "F16", "BF16"):
            raise ValueError(f"{where}: tensor {key} has dtype {dtype}: only F32, F16, BF16")
        shapes[key] = list(info["shape"])
    return shapes


def _modules(
    shapes: dict[str, list[int]],
    config: dict[str, Any],
    mc: ModelConfig,
    max_lora_rank: int,
    where: str,
) -> tuple[LoRAModule, ...]:
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(shapes):
        match = _TENSOR_NAME.match(key)
        if match is None or match[3] not in TARGET_MODULES:
            raise ValueError(
                f"{where}: tensor {key} adapts a module the engine does not: adapters may "
                f"target {', '.join(TARGET_MODULES)} of the decoder layers (not the "
                "embeddings or the lm_head)"
            )
        layer, module = int(match[1]), match[3]
        if layer >= mc.num_layers:
            raise ValueError(
                f"{where}: tensor {key} is for layer {layer}, but the base model has "
                f"{mc.num_layers} layers: an adapter for another model"
            )
        pairs.setdefault((layer, module), {})[match[4]] = key
    if not pairs:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA tensors")
    alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    modules: list[LoRAModule] = []
    for (layer, module), names in sorted(pairs.items()):
        if set(names) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_A or lora_B only")
        a_shape, b_shape = shapes[names["A"]], shapes[names["B"]]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise ValueError(
                f"{where}: layer {layer} {module}: lora_A {a_shape} and lora_B {b_shape} "
                "are not [r, in] and [out, r]"
            )
        rank = a_shape[0]
        if rank > max_lora_rank:
            raise ValueError(
                f"{where}: layer {layer} {module} has rank {rank}, above max_lora_rank="
                f"{max_lora_rank}: start the engine with a larger max_lora_rank"
            )
        want = _expected_shape(module, mc)
        got = (b_shape[0], a_shape[1])
        if any(w is not None and w != g for w, g in zip(want, got, strict=True)):
            raise ValueError(
                f"{where}: layer {layer} {module} maps {got[1]} features to {got[0]}, but the "
                f"base model's maps {want[1]} to {want[0]}: an adapter for another model"
            )
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules.append(LoRAModule(layer, module, rank, scale, names["A"], names["B"]))
    return tuple(modules)


def _expected_shape(module: str, mc: ModelConfig) -> tuple[int | None, int | None]:
    """(out_features, in_features) of the base model's projection (None: not known)."""
    hidden, q_width = mc.hidden_size, mc.num_attention_heads * mc.head_dim
    kv_width, inter = mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    return {
        "q_proj": (q_width, hidden),
        "k_proj": (kv_width, hidden),
        "v_proj": (kv_width, hidden),
        "o_proj": (hidden, q_width),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]
