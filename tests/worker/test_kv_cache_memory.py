"""The CPU KV cache's memory: zeroed, and resident only where blocks were written."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from asyncengine.worker.model_runner import _zeroed

CPU = torch.device("cpu")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_zeroed_is_a_writable_contiguous_zero_tensor() -> None:
    shape = (2, 3, 5, 16, 64)
    t = _zeroed(shape, torch.bfloat16, CPU)
    assert (t.shape, t.dtype, t.is_contiguous()) == (shape, torch.bfloat16, True)
    assert not t.any()
    t[1, 2, 4] = 3.0
    gc.collect()  # the mapping lives as long as the tensor, not as a local name
    assert t.sum().item() == 3.0 * 16 * 64
    assert torch.equal(t.clone(), t)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc/self/status")
def test_zeroed_cpu_pages_become_resident_only_when_written() -> None:
    size = 256 * 2**20
    before = _rss_bytes()
    t = _zeroed((size // 2,), torch.float16, CPU)
    assert _rss_bytes() - before < size // 8  # torch.zeros would commit all of it here
    t[: size // 8].fill_(1)  # a quarter of the elements: a quarter of the pages
    grown = _rss_bytes() - before
    assert size // 8 <= grown < size // 2
    del t
    gc.collect()
    assert _rss_bytes() - before < size // 8  # unmapped with the tensor


@pytest.mark.skipif(
    not Path("/proc/sys/vm/overcommit_memory").exists()
    or Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="needs a kernel that refuses mappings it could never back",
)
def test_a_cache_larger_than_the_machine_is_refused_with_the_settings_to_change() -> None:
    with pytest.raises(MemoryError, match="lower kv_cache_memory_bytes or num_kv_blocks"):
        _zeroed((2**49,), torch.bfloat16, CPU)  # 1 PiB
