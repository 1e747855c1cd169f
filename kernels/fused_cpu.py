"""Fused elementwise ops on CPU with the native kernels (`csrc/cpu_kernels.c`).

Each replaces a chain of torch ops with one pass, doing the same arithmetic in the same order
of roundings as the chain (fp32 inside, rounded to the dtype where torch rounds), so outputs
match transformers' to the last bit or within one rounding of the dtype:

- `rms_norm_cpu(x, weight, eps)`: transformers' Llama-style RMSNorm (seven ops).
- `add_rms_norm_cpu(x, residual, weight, eps)`: a pre-norm decoder's `residual = residual + x`
  (in place) then RMSNorm of it (eight ops).
- `rotary_cpu(q, k, cos, sin)`: rotary embedding of queries and keys in place, rotate-half
  layout (about twelve ops), optionally after Qwen3's per-head RMSNorms.
- `silu_mul_cpu(gate, up)`: `silu(gate) * up`, the gated MLP's activation (two ops).
- `argmax_cpu(x)`: torch.argmax over the rows of bf16/fp16/fp32 logits with no fp32 copy
  (torch's CPU argmax is a scalar loop; an fp32 copy of 64 x 32000 logits costs ~1 ms).
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CPU, one supported dtype, rows of stride 1."""
    dtype = tensors[0].dtype
    return all(
        t.device.type == "cpu" and t.dtype == dtype and t.dtype in DTYPE_CODES and t.stride(-1) == 1
        for t in tensors
    )


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim, as a new tensor like `x`."""
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    require_native().rms_norm(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), out.data_ptr(), x.shape[-1],
        weight.contiguous().data_ptr(), rows.shape[0], x.shape[-1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += x` (rounded to the dtype, in place), then RMSNorm of it, as a new tensor.

    Both `[..., N]` of one dtype with rows of unit stride; `residual` must be writable in place
    as 2-D rows (any row stride).
    """
    rows, res = _rows(x), residual.view(-1, residual.shape[-1])
    if res.stride(-1) != 1:
        raise ValueError("add_rms_norm_cpu: the residual's rows must be contiguous")
    out = torch.empty(x.shape, dtype=x.dtype)
    require_native().add_rms_norm(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0),
        out.data_ptr(), x.shape[-1], weight.contiguous().data_ptr(), rows.shape[0],
        x.shape[-1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_cpu(
    q: torch.Tensor,  # [T, H_q, D], heads of unit stride along D
    k: torch.Tensor,  # [T, H_kv, D]
    cos: torch.Tensor,  # [T, D] in q's dtype
    sin: torch.Tensor,  # [T, D]
    q_norm: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3), or None
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    value: torch.Tensor | None = None,  # [T, H_kv, D]: with kv_cache, written beside the keys
    kv_cache: torch.Tensor | None = None,  # [2, H_kv, blocks, block_size, D], cpu layout
    slot_mapping: torch.Tensor | None = None,  # [T] int64
) -> None:
    """Rotary embedding of q and k in place, as transformers' `apply_rotary_pos_emb`.

    With `q_norm` / `k_norm`, each head is first RMS-normalised (as Qwen3's `q_norm` /
    `k_norm` modules). With `kv_cache`, the rotated keys and `value` are also written to it
    at `slot_mapping`, as `paged_attention_cpu.reshape_and_cache_cpu` writes them (key blocks
    transposed): one pass instead of two. Any token and head strides; each head's D values,
    and cos and sin rows, must be contiguous.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_cpu: each head's values must be contiguous")
    c, s = cos.contiguous(), sin.contiguous()
    qn = q_norm.contiguous() if q_norm is not None else None
    kn = k_norm.contiguous() if k_norm is not None else None
    v_args: tuple[int | None, int, int] = (None, 0, 0)
    cache_args: tuple[int | None, int, int, int | None] = (None, 0, 0, None)
    if kv_cache is not None:
        if value is None or slot_mapping is None or value.stride(-1) != 1:
            raise ValueError(
                "rotary_cpu: a cache write needs values (rows of unit stride) and slots"
            )
        if not kv_cache.is_contiguous() or kv_cache.dtype != k.dtype:
            raise ValueError("rotary_cpu: the KV cache must be contiguous, in the keys' dtype")
        slots = slot_mapping.to(torch.int64).contiguous()
        v_args = (value.data_ptr(), value.stride(0), value.stride(1))
        cache_args = (kv_cache.data_ptr(), kv_cache.shape[2], kv_cache.shape[3], slots.data_ptr())
    require_native().rotary(
        DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), q.shape[1],
        k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
        c.data_ptr(), s.data_ptr(), c.stride(0), q.shape[0], q.shape[2],
        qn.data_ptr() if qn is not None else None, kn.data_ptr() if kn is not None else None,
        eps, *v_args, *cache_args, torch.get_num_threads(),
    )  # fmt: skip


def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, both `[..., N]` of one dtype, as a new tensor."""
    n = gate.shape[-1]
    g, u = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    require_native().silu_mul(
        DTYPE_CODES[gate.dtype], g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0),
        out.data_ptr(), n, g.shape[0], n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def argmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a [B, V] tensor: first index of the maximum (or of a NaN)."""
    rows = _rows(x)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    require_native().argmax_rows(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    # [R, N] with unit stride along N; the kernels take any row stride.
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
