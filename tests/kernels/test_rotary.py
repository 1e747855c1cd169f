"""Rotary embedding in place (neox and GPT-J styles, partial rotary): Triton against the torch
reference, and the reference against transformers' rotation and a complex multiplication."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.kernels.rotary import rotary_embedding_torch
from asyncengine.kernels.rotary_triton import rotary_embedding_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both compute in fp32 and round once; fused multiply-adds may flip that last rounding.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
MAX_POSITION = 512


def cos_sin_cache(rot_dim: int, base: float = 10000.0) -> torch.Tensor:  # [max_pos, rot_dim]
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_q_heads=st.integers(1, 4),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    partial=st.booleans(),
    is_neox=st.booleans(),
    with_key=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(
    device: str,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    partial: bool,
    is_neox: bool,
    with_key: bool,
    dtype: torch.dtype,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    cache = cos_sin_cache(head_dim // 2 if partial else head_dim)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=g)
    # Queries and keys as views into one fused QKV projection output.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    expected = qkv.clone()
    q_ref, k_ref = expected[:, :num_q_heads], expected[:, num_q_heads : num_q_heads + num_kv_heads]
    rotary_embedding_torch(positions, q_ref, k_ref if with_key else None, cache, is_neox)
    got = qkv.to(device)
    q, k = got[:, :num_q_heads], got[:, num_q_heads : num_q_heads + num_kv_heads]
    rotary_embedding_triton(
        positions.to(device), q, k if with_key else None, cache.to(device), is_neox
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
    # Values (and keys when not given) are untouched.
    assert torch.equal(
        got[:, num_q_heads + num_kv_heads :].cpu(), qkv[:, num_q_heads + num_kv_heads :]
    )


def test_reference_neox_equals_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(6)
    cache = cos_sin_cache(64)
    positions = torch.randint(0, MAX_POSITION, (9,), generator=g)
    q = torch.randn(9, 4, 64, generator=g)
    k = torch.randn(9, 2, 64, generator=g)
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, 32] each
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # transformers' [T, 64]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    rotary_embedding_torch(positions, q, k, cache, is_neox=True)
    torch.testing.assert_close(q, q_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_hf, atol=1e-6, rtol=1e-6)


def test_reference_gptj_is_a_complex_rotation_of_adjacent_pairs() -> None:
    g = torch.Generator().manual_seed(7)
    cache = cos_sin_cache(32)
    positions = torch.randint(0, MAX_POSITION, (5,), generator=g)
    q = torch.randn(5, 3, 32, generator=g)
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, 16]
    turn = torch.complex(cos, sin)[:, None, :]  # [T, 1, 16]
    expected = torch.view_as_real(torch.view_as_complex(q.view(5, 3, 16, 2)) * turn).view(5, 3, 32)
    rotary_embedding_torch(positions, q, None, cache, is_neox=False)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-6)
