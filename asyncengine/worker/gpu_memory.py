"""Sizing the KV cache on a GPU, as a server does: `gpu_memory_utilization` of the card's total
memory is this engine's, and the KV cache gets what the weights and the largest step's
activations (measured by a profiling forward) leave of it.

Measured per process, so that several engines can share one card (two at 0.4 each): the
engine's use is torch's peak allocation during the profiling forward (the weights included)
plus what the process took outside torch's allocator since it started (cuBLAS workspaces,
Triton modules, communication buffers): the drop in the card's free memory that torch's own
reservations don't explain. The CUDA context itself (a few hundred MiB, taken before the first
snapshot) and the decode graphs' memory pool (captured after the KV cache, small next to the
largest step's activations) are left out of the share, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """The card's free and total memory, and torch's reservation and allocation in this
    process, in bytes."""

    free: int
    total: int
    torch_reserved: int
    torch_allocated: int


def snapshot(device: torch.device) -> MemorySnapshot:
    """The memory of `device` now (after handing torch's unused cached blocks back)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(
        free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    )


def kv_cache_budget(
    baseline: MemorySnapshot,  # when the worker started, before the weights
    after_profile: MemorySnapshot,  # after the profiling forward
    peak_allocated: int,  # torch's peak allocation in the profiling forward (the process's)
    utilization: float,  # gpu_memory_utilization
) -> int:
    """The bytes the KV cache may take. ValueError naming the numbers when it can't have any,
    or when more than the card has free."""
    total = baseline.total
    share = int(total * utilization)
    reserved_growth = after_profile.torch_reserved - baseline.torch_reserved
    outside_torch = max(0, (baseline.free - after_profile.free) - reserved_growth)
    # Relative to the baseline: another engine in this process (two `LLM`s) is not ours.
    used = peak_allocated - baseline.torch_allocated + outside_torch
    budget = share - used
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {share / _GIB:.2f} GiB of "
            f"the GPU's {total / _GIB:.2f} GiB, but the weights and the largest step's "
            f"activations already take {used / _GIB:.2f} GiB, leaving nothing for the KV "
            "cache: raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "max_num_seqs, or give kv_cache_memory_bytes"
        )
    # The activations were freed after profiling: they must fit beside the cache too.
    activations = max(0, peak_allocated - after_profile.torch_allocated)
    available = after_profile.free - activations
    if budget > available:
        others = total - baseline.free
        raise ValueError(
            f"the KV cache would take {budget / _GIB:.2f} GiB (gpu_memory_utilization="
            f"{utilization} of the GPU's {total / _GIB:.2f} GiB, less {used / _GIB:.2f} GiB "
            f"for the weights and activations), but only {available / _GIB:.2f} GiB is free "
            f"beside them: other processes held {others / _GIB:.2f} GiB when this engine "
            "started. Lower gpu_memory_utilization, or give kv_cache_memory_bytes"
        )
    return budget
