"""Which GPU each engine core and each of its workers runs on.

The rule: every tensor-parallel worker of every data-parallel rank has a GPU of its own.

- `data_parallel_backend="mp"` (rank processes on this machine): the ranks split the GPUs
  this machine shows them (CUDA_VISIBLE_DEVICES, or all of them) in order, `tensor_parallel_size`
  each: rank r's worker t runs on visible GPU r * tp + t.
- `data_parallel_backend="ray"`: Ray gives each rank's actor its `tensor_parallel_size` GPUs
  (num_gpus, client/cores/ray_core.py) and sets CUDA_VISIBLE_DEVICES to them.

Either way an engine core process sees exactly its own GPUs: an mp rank narrows
CUDA_VISIBLE_DEVICES to its share (`claim_rank_gpus`) before anything touches CUDA, and its
worker processes inherit it. Inside a core, worker t is simply cuda:t (`worker_device`), in
every thread and library (Triton, NCCL and CUDA graphs use the current device), as it is
under Ray. The client checks that there are enough GPUs before it starts anything
(`asyncengine.config.check_gpu_count`).

This module imports torch only inside `worker_device`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from asyncengine.config import ParallelConfig
from asyncengine.gpus import visible_gpus

if TYPE_CHECKING:
    import torch

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def rank_gpus(parallel: ParallelConfig, visible: list[str] | None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of rank `parallel.data_parallel_rank`'s workers, in
    worker order, out of the `visible` ones (None: not known, so indices 0, 1, ... of what
    CUDA shows). ValueError when `visible` has too few."""
    tp, rank = parallel.tensor_parallel_size, parallel.data_parallel_rank
    start = rank * tp
    if visible is None:
        return [str(i) for i in range(start, start + tp)]
    if start + tp > len(visible):
        raise ValueError(
            f"data-parallel rank {rank} needs GPUs {start}..{start + tp - 1} of the visible "
            f"ones, but {len(visible)} {'is' if len(visible) == 1 else 'are'} visible "
            f"({', '.join(visible) or 'none'})"
        )
    return visible[start : start + tp]


def claim_rank_gpus(
    parallel: ParallelConfig,
    device: str,
    environ: MutableMapping[str, str] = os.environ,
) -> str | None:
    """In an engine core's own process, before CUDA starts: narrow CUDA_VISIBLE_DEVICES to
    this rank's GPUs (mp ranks on CUDA; Ray has narrowed it already). The value set, or
    None where nothing changed."""
    if device != "cuda" or parallel.data_parallel_backend != "mp":
        return None
    value = ",".join(rank_gpus(parallel, visible_gpus(environ)))
    environ[CUDA_VISIBLE_DEVICES] = value
    return value


def worker_device(device: str, tp_rank: int) -> torch.device:
    """The torch device of tensor-parallel worker `tp_rank` of this engine core: cuda:tp_rank
    (made the current CUDA device of the calling thread), or the CPU. RuntimeError naming the
    numbers when this process sees too few GPUs."""
    import torch

    if device != "cuda":
        return torch.device(device)
    count = torch.cuda.device_count()
    if tp_rank >= count:
        raise RuntimeError(
            f"tensor-parallel worker {tp_rank} needs GPU {tp_rank} of this engine core's, "
            f"but it sees {count} ({CUDA_VISIBLE_DEVICES}="
            f"{os.environ.get(CUDA_VISIBLE_DEVICES)!r}): each worker of each rank needs a "
            "GPU of its own"
        )
    cuda = torch.device("cuda", tp_rank)
    torch.cuda.set_device(cuda)
    return cuda
