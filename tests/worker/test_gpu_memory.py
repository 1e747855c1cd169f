"""Sizing the KV cache on a GPU from `gpu_memory_utilization` (worker/gpu_memory.py).

The arithmetic is checked everywhere; two engines sharing one card only on a GPU (`gpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine.worker.gpu_memory import MemorySnapshot, kv_cache_budget

GIB = 2**30


def _snapshots(
    *, others: int = 0, weights: int = 2 * GIB, workspace: int = GIB // 2
) -> tuple[MemorySnapshot, MemorySnapshot]:
    total = 100 * GIB
    baseline = MemorySnapshot(free=total - others, total=total, torch_reserved=0, torch_allocated=0)
    after = MemorySnapshot(
        free=total - others - weights - workspace,
        total=total,
        torch_reserved=weights,
        torch_allocated=weights,
    )
    return baseline, after


def test_the_cache_gets_the_share_less_weights_activations_and_workspaces() -> None:
    baseline, after = _snapshots()
    peak = 2 * GIB + 3 * GIB  # the weights, and 3 GiB of activations at the largest step
    budget = kv_cache_budget(baseline, after, peak, 0.4)
    assert budget == 40 * GIB - 5 * GIB - GIB // 2


def test_only_this_engines_allocations_count_when_two_share_a_process() -> None:
    # A first engine in this process holds 30 GiB of torch memory before this one starts.
    first = 30 * GIB
    baseline = MemorySnapshot(
        free=70 * GIB, total=100 * GIB, torch_reserved=first, torch_allocated=first
    )
    after = MemorySnapshot(
        free=68 * GIB,
        total=100 * GIB,
        torch_reserved=first + 2 * GIB,
        torch_allocated=first + 2 * GIB,
    )
    assert kv_cache_budget(baseline, after, first + 3 * GIB, 0.4) == 37 * GIB


def test_a_share_the_weights_fill_is_refused_with_the_numbers() -> None:
    baseline, after = _snapshots()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.05 gives this engine 5\.00"):
        kv_cache_budget(baseline, after, 6 * GIB, 0.05)


def test_a_share_larger_than_the_free_memory_is_refused_naming_the_other_processes() -> None:
    baseline, after = _snapshots(others=60 * GIB)
    with pytest.raises(ValueError, match=r"other processes held 60\.00 GiB"):
        kv_cache_budget(baseline, after, 3 * GIB, 0.9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Inside gpu_check.sh's limit for the gpu tests, so that a hang dumps its stacks there.
@pytest.mark.timeout(120)
def test_two_engines_with_0_4_each_run_on_one_card(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from asyncengine import LLM, SamplingParams

    # KV blocks 32x the default tiny model's: with its 4 KB blocks (bf16), 0.4 of an H200 is 14
    # million blocks, each a Python object of the scheduler's pool (seconds and GBs to make).
    model = tiny_model_factory(
        "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        num_hidden_layers=8, intermediate_size=512,
    )  # fmt: skip
    total = torch.cuda.mem_get_info()[1]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = LLM(model, device="cuda", gpu_memory_utilization=0.4)
    try:
        second = LLM(model, device="cuda", gpu_memory_utilization=0.4)
        try:
            for llm in (first, second):
                out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
                assert len(out[0].outputs[0].token_ids) == 8
            # Both engines together stay inside the two shares (the allocator's rounding of
            # its segments aside).
            assert torch.cuda.memory_reserved() <= 0.8 * total + GIB // 2
        finally:
            second.shutdown()
    finally:
        first.shutdown()
