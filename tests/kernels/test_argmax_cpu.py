"""Greedy argmax on CPU (the native kernel): torch.argmax's answer, ties and NaNs included."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.argmax_cpu import argmax_cpu
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
