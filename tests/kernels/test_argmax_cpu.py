"""Greedy argmax on CPU (the native kernel): torch.argmax's answer, ties and NaNs included."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.argmax_cpu import argmax_cpu, argmax_nan_rows
from asyncengine.kernels.cpu_native import load_native, unavailable_reason

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_is_torch_argmax(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 1000, generator=g) * 0.01).to(dtype)  # many ties in half precision
    x[1, 7] = x[1, 900] = float("nan")  # the first NaN wins, as in torch
    x[2, 999] = float("nan")  # a NaN in the tail, past the last full 16 lanes
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 998] = 1e4  # the maximum in the tail
    for rows in (x, x[:, 3:], x[:, :13], x[:0]):  # strided rows, a short row, no rows
        assert torch.equal(argmax_cpu(rows), rows.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [3, 40])  # in the calling thread, and on OpenMP's team
def test_counts_the_rows_holding_a_nan(dtype: torch.dtype, num_rows: int) -> None:
    x = torch.randn(num_rows, 4000, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert argmax_nan_rows(x)[1] == 0
    x[0, 5] = x[0, 6] = float("nan")  # one row, two NaNs
    x[num_rows - 1, 3999] = float("nan")  # in the tail, past the last full 16 lanes
    x[1, 2] = float("inf")  # not a NaN
    tokens, nan_rows = argmax_nan_rows(x)
    assert nan_rows == 2
    assert torch.equal(tokens, x.float().argmax(dim=-1))
