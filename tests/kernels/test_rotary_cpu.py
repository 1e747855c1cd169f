"""Rotary embedding on CPU (the native kernel): transformers' `apply_rotary_pos_emb` (after
Qwen3's per-head norms), bit for bit, and its fused cache write is the cache writer's."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.reshape_and_cache_cpu import reshape_and_cache_cpu
from asyncengine.kernels.rotary_cpu import rotary_cpu

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_norms", [False, True])
def test_rotary_is_transformers_rotary(dtype: torch.dtype, head_norms: bool) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(3)
    num_tokens, hq, hkv, d = 13, 6, 2, 32
    # q and k as column views of one [T, (hq + 2 hkv) * D] projection, as the forward has them.
    qkv = (torch.randn(num_tokens, hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    pos = torch.arange(100, 100 + num_tokens).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [T, D], as LlamaRotaryEmbedding
    want_q, want_k = q.clone(), k.clone()
    q_norm = k_norm = None
    if head_norms:  # Qwen3 normalises each head first
        q_norm, k_norm = Qwen3RMSNorm(d, eps=1e-6).to(dtype), Qwen3RMSNorm(d, eps=1e-6).to(dtype)
        q_norm.weight.data = torch.randn(d, generator=g).to(dtype)
        k_norm.weight.data = torch.randn(d, generator=g).to(dtype)
        want_q, want_k = q_norm(want_q), k_norm(want_k)
    # transformers' layout: [B, H, T, D] with cos/sin [B, T, D]
    want_q, want_k = apply_rotary_pos_emb(
        want_q.transpose(0, 1)[None], want_k.transpose(0, 1)[None], cos[None], sin[None]
    )
    rotary_cpu(
        q, k, cos, sin,
        q_norm.weight if q_norm is not None else None,
        k_norm.weight if k_norm is not None else None,
        1e-6,
    )  # fmt: skip
    got_q, got_k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    if head_norms and dtype != torch.bfloat16:  # the norms' summation order
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
        torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    else:  # every product and sum rounded as torch rounds it, no FMA: bit for bit
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, hq + hkv :], qkv[:, hq + hkv :].clone())  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_writes_the_cache_as_the_cache_writer(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    num_tokens, hq, hkv, d = 9, 4, 2, 16
    qkv = torch.randn(num_tokens, hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    cos, sin = (
        torch.randn(num_tokens, d, generator=g).to(dtype),
        torch.rand(num_tokens, d).to(dtype),
    )
    slots = torch.tensor([3, 17, 18, 40, -1, 5, 0, 33, 47])  # -1: padding, not written
    want_q, want_k = q.clone(), k.clone()
    rotary_cpu(want_q, want_k, cos, sin)
    want_cache = torch.zeros(2, hkv, 3, 16, d, dtype=dtype)
    reshape_and_cache_cpu(want_k, v, want_cache, slots)
    cache = torch.zeros_like(want_cache)
    rotary_cpu(q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(cache, want_cache)
    with pytest.raises(ValueError, match="values"):
        rotary_cpu(q, k, cos, sin, kv_cache=cache, slot_mapping=slots)


def test_rotary_rounds_special_values_as_torch() -> None:
    """The vectorised bf16 path: infinities, NaNs, huge and tiny values round as torch's ops do."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(6)
    num_tokens, heads, d = 5, 2, 64
    q = (torch.randn(num_tokens, heads, d, generator=g) * 3).to(torch.bfloat16)
    k = (torch.randn(num_tokens, heads, d, generator=g) * 3).to(torch.bfloat16)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1e-40, 0.0])
    q[0, 0, : specials.numel()] = specials.to(torch.bfloat16)
    k[1, 1, 32 : 32 + specials.numel()] = specials.to(torch.bfloat16)
    cos = torch.randn(num_tokens, d, generator=g).to(torch.bfloat16)
    sin = torch.randn(num_tokens, d, generator=g).to(torch.bfloat16)
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    rotary_cpu(q, k, cos, sin)
    for got, want in ((q.transpose(0, 1)[None], want_q), (k.transpose(0, 1)[None], want_k)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
