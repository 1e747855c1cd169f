"""The "cpu" backend's cache writer: key blocks transposed, negative slots skipped. (That it
writes exactly the reference cache, in its own layout, is checked with every attention batch in
test_paged_attention_cpu.py.)"""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.reshape_and_cache_cpu import read_cache_cpu, reshape_and_cache_cpu

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())


def test_negative_slots_are_skipped() -> None:
    cache = torch.zeros(2, 2, 3, 16, 8)
    key = torch.ones(2, 2, 8)
    reshape_and_cache_cpu(key, key * 2, cache, torch.tensor([-1, 5]))
    ref = read_cache_cpu(cache)
    assert torch.equal(ref[0, :, 0, 5], torch.ones(2, 8))
    assert torch.equal(ref[1, :, 0, 5], torch.full((2, 8), 2.0))
    assert int((ref != 0).sum()) == 1 * 2 * 8 * 2  # one token, two heads, K and V
