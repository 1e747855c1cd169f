"""`LeanLayer`: one decoder layer's weights as the lean CPU forward runs them (`cpu_forward.py`
loops over them; `decode_layers.py` hands their addresses to one native call)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True)
class LeanLayer:
    """One decoder layer's weights, as the lean forward runs them."""

    input_norm: torch.Tensor  # [hidden] weights
    post_norm: torch.Tensor
    eps: float
    # q, k and v from one joint GEMM (split by column), or three.
    qkv: nn.Module | None
    q_proj: nn.Module | None
    k_proj: nn.Module | None
    v_proj: nn.Module | None
    q_norm: torch.Tensor | None  # Qwen3's per-head norms, [D]
    k_norm: torch.Tensor | None
    head_eps: float
    num_kv_heads: int
    o_proj: nn.Module
    gate_up: nn.Module | None
    gate_proj: nn.Module | None
    up_proj: nn.Module | None
    down_proj: nn.Module
    scale: float
