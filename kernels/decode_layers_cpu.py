"""The lean CPU forward's decoder layers in one native call (`csrc/decode_layers.c`): the
binding. `asyncengine/model/decode_layers.py` decides where it applies and builds its table.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import NativeKernels
from asyncengine.kernels.paged_attention_cpu import CpuAttentionPlan, unsound_tables_message

# ae_kernels.h's enum ae_layer_field, in its order (tests/model/test_decode_layers.py checks):
# the columns of the per-layer table of addresses. A weight's "*_kp" column is 0 for the dense
# kernel's panels (linear_dense.c), > 0 the padded input extent of linear.c's blocks, < 0 for
# GGUF blocks of quantized format code -kp - 1 (quant_formats.FORMATS; `quant_kp`).
LAYER_FIELDS = (
    "in_norm", "post_norm", "q_w", "k_w", "v_w", "q_b", "k_b", "v_b", "o_w", "o_b",
    "gate_w", "up_w", "gate_b", "up_b", "down_w", "down_b", "q_norm", "k_norm", "kv_cache",
    "q_kp", "k_kp", "v_kp", "o_kp", "gate_kp", "up_kp", "down_kp",
)  # fmt: skip


def quant_kp(code: int) -> int:
    """The "*_kp" value of a weight in GGUF blocks of quantized format `code`."""
    return -code - 1


def decode_layers_bf16(
    lib: NativeKernels,
    table: torch.Tensor,  # [L, len(LAYER_FIELDS)] int64 addresses (and packed extents)
    dims: tuple[int, int, int, int, int],  # hidden, H_q, H_kv, D, intermediate
    residual: torch.Tensor,  # [T, hidden] bf16, contiguous: updated in place
    cos: torch.Tensor,  # [T, D] bf16, rows contiguous
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    cache_shape: tuple[int, ...],  # every layer's [2, H_kv, blocks, block_size, D]
    plan: CpuAttentionPlan,  # without prefills (decodes and short chunks only)
    eps: float,
    head_eps: float,
    scale: float,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [T, hidden]: the last layer's MLP output, not yet added to residual
    """Run the L layers (see csrc/decode_layers.c) on `residual`; with `lora`, the step's
    LoRA segments (int64 rows [M], seg_rows [S + 1], and per segment the address of its
    adapter's [L][4][12] descriptors: kernels/lora.py) get their adapters' deltas."""
    if plan.prefills:
        raise ValueError("decode_layers_bf16: a step with prefill chunks for SDPA")
    hidden, hq, hkv, d, inter = dims
    num_tokens = residual.shape[0]
    scratch = torch.empty(
        lib.decode_layers_scratch(num_tokens, hidden, hq, hkv, d, inter), dtype=torch.bfloat16
    )
    mlp_out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    q_start, block_table = plan.q_start, plan.block_table
    status = lib.decode_layers_bf16(
        table.data_ptr(), table.shape[0], num_tokens, hidden, hq, hkv, d, inter,
        residual.data_ptr(), scratch.data_ptr(), mlp_out.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), slot_mapping.data_ptr(),
        cache_shape[2], cache_shape[3],
        q_start.data_ptr(), plan.q_lens.data_ptr(), plan.seq_lens.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), q_start.numel(),
        eps, head_eps, scale,
        *((0, 0, 0, 0) if lora is None else
          (lora[0].data_ptr(), lora[1].data_ptr(), lora[2].numel(), lora[2].data_ptr())),
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise ValueError(unsound_tables_message(plan, cache_shape[2], cache_shape[3]))
    if status != 0:
        raise MemoryError(f"decode_layers_bf16: no memory for a {num_tokens}-token step's scratch")
    return mlp_out
