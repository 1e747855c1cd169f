"""Fused ops swapped into transformers models, per module instance (the classes are untouched).

transformers' Llama-style RMSNorm runs about seven elementwise kernels per call (upcast, square,
mean, add, rsqrt, multiply, downcast, weight), and the gated MLP two more between its GEMMs
(SiLU, multiply). The model runner calls:
- `use_triton_rms_norm` for a model on CUDA whose attention backend is "triton";
- `use_native_cpu_ops` for a model on CPU whose attention backend is "cpu" (the native C
  kernels): RMSNorm and SiLU-and-multiply, each one pass.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from asyncengine.model.attention import get_backend

# Norm classes whose forward is LlamaRMSNorm's: fp32 mean square, rounded before the weight.
LLAMA_STYLE_RMS_NORMS = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
)


def use_triton_rms_norm(model: torch.nn.Module, device: torch.device) -> int:
    """Route each Llama-style RMSNorm module of `model` through the Triton kernel.

    Returns how many modules were switched. Other norm classes (e.g. Gemma's `1 + weight`) are
    left alone. Raises like `get_backend("triton", device)` when the kernels cannot run there.
    """
    get_backend("triton", device)  # sets up the interpreter on CPU; checks the kernels' mode
    count = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_STYLE_RMS_NORMS:
            original = module.forward
            module.forward = types.MethodType(_make_forward(original), module)
            count += 1
    return count


# Gated MLP classes whose forward is `down(act(gate(x)) * up(x))`.
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def use_native_cpu_ops(model: torch.nn.Module) -> tuple[int, int]:
    """Route Llama-style RMSNorms and SiLU-gated MLPs of `model` through the native kernels.

    Returns how many norm and MLP modules were switched. Only where the native kernels are
    built (`loader.choose_model`: without them the model runs as transformers defines it).
    Inputs the kernels don't take (mixed dtypes) go through the original forward.
    """
    norms = mlps = 0
    for module in model.modules():
        name = type(module).__name__
        if name in LLAMA_STYLE_RMS_NORMS:
            module.forward = types.MethodType(_native_norm_forward(module.forward), module)
            norms += 1
        elif name in GATED_MLPS and type(getattr(module, "act_fn", None)).__name__ in _SILUS:
            module.forward = types.MethodType(_native_mlp_forward(), module)
            mlps += 1
    return norms, mlps


_SILUS = frozenset({"SiLUActivation", "SiLU"})


def _native_norm_forward(original: Any) -> Any:
    from asyncengine.kernels.cpu_native import supported
    from asyncengine.kernels.rms_norm_cpu import rms_norm_cpu

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        if not supported(hidden_states, weight):
            return original(hidden_states)  # type: ignore[no-any-return]
        return rms_norm_cpu(hidden_states, weight, float(self.variance_epsilon))

    return forward


def _native_mlp_forward() -> Any:
    from asyncengine.kernels.cpu_native import supported
    from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not supported(gate, up):
            return self.down_proj(self.act_fn(gate) * up)  # type: ignore[no-any-return]
        return self.down_proj(silu_mul_cpu(gate, up))  # type: ignore[no-any-return]

    return forward


def _make_forward(original: Any) -> Any:
    from asyncengine.kernels.rms_norm_triton import rms_norm_triton

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        if hidden_states.dtype != weight.dtype:
            # transformers would return the promoted dtype; keep its own path for that case.
            return original(hidden_states)  # type: ignore[no-any-return]
        return rms_norm_triton(hidden_states, weight, float(self.variance_epsilon))

    return forward
