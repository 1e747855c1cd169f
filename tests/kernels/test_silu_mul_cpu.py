"""SiLU-and-multiply on CPU (the native kernel): torch's `silu(gate) * up`, bit for bit in bf16."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    torch.randn(96 + 37 * 2 * 96, generator=g)  # the draws test_rms_norm_cpu's inputs take
    gate = (torch.randn(37, 200, generator=g) * 4).to(dtype)
    up = torch.randn(37, 200, generator=g).to(dtype)
    got_act, want_act = silu_mul_cpu(gate, up), torch.nn.functional.silu(gate) * up
    if dtype == torch.bfloat16:  # same roundings in the same places: bit for bit
        assert torch.equal(got_act, want_act)
    else:  # fp32: another summation order; fp16: a rare last-bit difference
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got_act, want_act, atol=tol, rtol=tol)
