"""RMSNorm on CPU (the native kernels): transformers' LlamaRMSNorm, with and without the fused
residual add, bit for bit in bf16."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.rms_norm_cpu import rms_norm_cpu

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (torch.randn(37, 2, 96, generator=g) * 3).to(dtype)
    strided = x[:, 1]  # rows 192 elements apart
    got_norm, want_norm = rms_norm_cpu(strided, norm.weight, 1e-6), norm(strided)
    if dtype == torch.bfloat16:  # same roundings in the same places: bit for bit
        assert torch.equal(got_norm, want_norm)
    else:  # fp32: another summation order; fp16: a rare last-bit difference
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got_norm, want_norm, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_a_residual_it_is_the_residual_add_then_the_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (torch.randn(37, 96, generator=g) * 3).to(dtype)
    residual = torch.randn(37, 96, generator=g).to(dtype)
    want_residual = residual + x
    want = norm(want_residual)
    got = rms_norm_cpu(x, norm.weight, 1e-5, residual)
    assert torch.equal(residual, want_residual)  # the add rounds once, as torch's
    if dtype == torch.bfloat16:  # the norm rounds where transformers' does: bit for bit
        assert torch.equal(got, want)
    else:  # another summation order (fp32); a rare last-bit difference (fp16)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
