"""reshape_and_cache on CPU: the native kernel (`csrc/rotary_cache.c`), the "cpu" backend's.

Same contract as `reshape_and_cache_torch` (see `reshape_and_cache.py`), with one difference in
the cache: each key block is stored transposed, `[D, block_size]` inside the `[2, H_kv,
num_blocks, block_size, D]` tensor (why: `csrc/attention.c`). Only this backend writes and
reads that layout (`paged_attention_cpu.py`, and `rotary_cpu.py`'s fused cache write), so a
cache is written and read by it alone. `read_cache_cpu` and `to_cpu_layout` convert between the
two layouts, for tests and checks.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import DTYPE_CODES, require_native


def reshape_and_cache_cpu(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], key blocks transposed
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write K/V rows into their cache slots, in place, key blocks transposed. A negative slot
    skips its token (padding)."""
    check_cache(kv_cache)
    k = rows_contiguous(key.to(kv_cache.dtype))
    v = rows_contiguous(value.to(kv_cache.dtype))
    slots = slot_mapping.to(torch.int64).contiguous()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    require_native().reshape_and_cache(
        DTYPE_CODES[kv_cache.dtype],
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
        slots.data_ptr(), slots.numel(), torch.get_num_threads(),
    )  # fmt: skip


def read_cache_cpu(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache in the reference layout (keys un-transposed): a copy, for tests and checks."""
    out = kv_cache.clone()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    out[0] = kv_cache[0].reshape(num_kv_heads, num_blocks, head_dim, block_size).transpose(-1, -2)
    return out


def to_cpu_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A reference-layout cache converted to this backend's (keys transposed): a copy."""
    out = kv_cache.clone()
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    out[0].view(num_kv_heads, num_blocks, head_dim, block_size).copy_(kv_cache[0].transpose(-1, -2))
    return out


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself where each head's D values are adjacent (the kernels take any token and head
    strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache(kv_cache: torch.Tensor) -> None:
    """ValueError unless the native kernels can read and write this cache."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("the native CPU kernels need a contiguous CPU KV cache")
    if kv_cache.dtype not in DTYPE_CODES:
        raise ValueError(f"KV cache dtype {kv_cache.dtype}: expected float32, bfloat16, float16")
