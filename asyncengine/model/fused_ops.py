"""Fused Triton ops swapped into transformers models: RMSNorm, for now.

transformers' Llama-style RMSNorm runs about seven elementwise kernels per call (upcast, square,
mean, add, rsqrt, multiply, downcast, weight); `rms_norm_triton` is one pass. The model runner
calls `use_triton_rms_norm` for a model on CUDA whose attention backend is "triton"; on CPU the
torch path is left exactly as transformers defines it.
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


def _make_forward(original: Any) -> Any:
    from asyncengine.kernels.rms_norm_triton import rms_norm_triton

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        if hidden_states.dtype != weight.dtype:
            # transformers would return the promoted dtype; keep its own path for that case.
            return original(hidden_states)  # type: ignore[no-any-return]
        # The kernel works in place on contiguous rows: normalise a copy, as the module returns
        # a new tensor.
        out = hidden_states.clone(memory_format=torch.contiguous_format)  # [..., N]
        rms_norm_triton(out.view(-1, out.shape[-1]), weight, float(self.variance_epsilon))
        return out

    return forward
