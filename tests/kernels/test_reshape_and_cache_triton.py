"""reshape_and_cache: the Triton kernel writes exactly what the torch reference writes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.kernels.reshape_and_cache import reshape_and_cache_torch
from asyncengine.kernels.reshape_and_cache_triton import reshape_and_cache_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 32, 64, 80, 128, 256]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(
    device: str,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    # Keys and values as the model hands them over: views of a [H, T, D] tensor.
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=g).to(dtype).transpose(0, 1)
    value = torch.randn(num_kv_heads, num_tokens, head_dim, generator=g).to(dtype).transpose(0, 1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    expected = cache.clone()
    reshape_and_cache_torch(key, value, expected, slots)
    got = cache.to(device)
    reshape_and_cache_triton(key.to(device), value.to(device), got, slots.to(device))
    assert torch.equal(got.cpu(), expected)


def test_negative_slots_are_skipped_and_dtype_converts(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 2, 4, 16, 32, dtype=torch.float16)
    key = torch.randn(5, 2, 32, generator=g)  # fp32 into an fp16 cache
    value = torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([3, -1, 40, -1, 17])
    got = cache.to(device)
    reshape_and_cache_triton(key.to(device), value.to(device), got, slots.to(device))
    keep = slots >= 0
    expected = cache.clone()
    reshape_and_cache_torch(key[keep], value[keep], expected, slots[keep])
    assert torch.equal(got.cpu(), expected)
