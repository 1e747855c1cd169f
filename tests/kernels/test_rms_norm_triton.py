"""Fused RMSNorm (optional residual add, in place): Triton against the torch reference, and the
reference against transformers' LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.kernels.rms_norm import rms_norm_torch
from asyncengine.kernels.rms_norm_triton import rms_norm_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Triton's rsqrt and summation order differ from torch's: a rounding step in the output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@settings(max_examples=25, deadline=None)
@given(
    num_rows=st.integers(1, 40),
    hidden=st.sampled_from([16, 64, 100, 256, 1000, 2048]),
    dtype=st.sampled_from(DTYPES),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(
    device: str, num_rows: int, hidden: int, dtype: torch.dtype, with_residual: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, hidden, generator=g) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    residual = torch.randn(num_rows, hidden, generator=g).to(dtype) if with_residual else None
    expected_r = residual.clone() if residual is not None else None
    expected_x = rms_norm_torch(x, weight, 1e-6, expected_r)
    got_r = residual.to(device) if residual is not None else None
    got_x = rms_norm_triton(x.to(device), weight.to(device), 1e-6, got_r)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_x.cpu(), expected_x, atol=tol, rtol=tol)
    if residual is not None:
        assert got_r is not None and expected_r is not None
        # The residual sum is one rounded add, the same in both.
        assert torch.equal(got_r.cpu(), expected_r)


def test_strided_rows(device: str) -> None:
    """Rows of a wider tensor (a view with a row stride larger than its width)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 96, generator=g)
    weight = torch.rand(64, generator=g)
    expected = rms_norm_torch(base[:, :64], weight, 1e-5)
    got = base.to(device)
    out = rms_norm_triton(got[:, :64], weight.to(device), 1e-5)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.cpu(), base)  # the input, and the rest of each row, untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_llama_rms_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(4)
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data = torch.rand(64, generator=g).to(dtype) + 0.5
    x = torch.randn(5, 64, generator=g).to(dtype)
    residual = torch.randn(5, 64, generator=g).to(dtype)
    # A pre-norm decoder layer: hidden = residual + hidden; residual = hidden; norm(hidden).
    expected_residual = residual + x
    expected = norm(expected_residual)
    got_x = x.clone()
    got_residual = residual.clone()
    got = rms_norm_torch(got_x, norm.weight, 1e-6, got_residual)
    assert torch.equal(got_residual, expected_residual)
    assert torch.equal(got, expected)
    assert torch.equal(got_x, x)  # the input is left as it was
