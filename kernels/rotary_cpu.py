"""Rotary embedding of queries and keys in place on CPU, optionally after Qwen3's per-head
RMSNorms and fused with the paged cache write: the native kernel (`csrc/rotary_cache.c`).

The rotate-half layout of transformers' `apply_rotary_pos_emb` (Llama, Mistral, Qwen), with
its roundings: about twelve torch ops in one pass, bit for bit in fp32 and bf16. The lean CPU
forward (`asyncengine/model/cpu_forward.py`) runs it with the cache write, one pass over each
token's keys instead of two.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native


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
    at `slot_mapping`, as `reshape_and_cache_cpu` writes them (key blocks
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
