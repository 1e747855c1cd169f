"""A grammar's token bitmask on CPU logits (the native kernel): exactly the reference mask."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.bitmask_cpu import apply_bitmask_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())


def _reference(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    v = logits.shape[1]
    for i, r in enumerate(rows):
        for t in range(v):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_is_the_reference_mask(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    v = 200  # 6.25 words: the last word is partial, its high bits ignored
    logits = torch.randn(6, v, generator=g).to(dtype)
    rows = [4, 0, 2]
    words = torch.randint(-(2**31), 2**31 - 1, (3, 8), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    words[0, 1] = 0  # a whole word forbidden
    words[1, :] = -1  # a row with everything allowed
    words[2, 3] = -1  # a whole word allowed
    expected = _reference(logits, rows, words)
    # Strided rows (a view of wider logits, as the model runner's [:, :V] slice) work too.
    wide = torch.zeros(6, v + 40, dtype=dtype)
    wide[:, :v] = logits
    for target in (logits, wide[:, :v]):
        apply_bitmask_cpu(target, torch.tensor(rows), words)
        assert torch.equal(target, expected)
    assert torch.equal(wide[:, v:], torch.zeros(6, 40, dtype=dtype))  # past V: untouched


def test_no_rows_is_a_no_op() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_bitmask_cpu(
        logits, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int32)
    )
    assert torch.equal(logits, before)
