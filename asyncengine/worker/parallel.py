"""The tensor-parallel process group of one worker: join it, reduce over it, share tokens.

Every rank runs the same packed batch through its shard of the model. Row-parallel layers
sum their partial outputs with `all_reduce`; only rank 0 computes logits and samples, and it
hands the sampled token ids to the other ranks with `broadcast_token_ids`, so every rank's
copy of each request's tokens stays identical without trusting bitwise-equal logits.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import FileStore, Store  # type: ignore[attr-defined]

# gloo (CPU) reduces bf16/fp16 slowly and less accurately; sum those in fp32 there.
_REDUCE_IN_FP32 = (torch.bfloat16, torch.float16)
# A rank that waits this long on a collective gives up (its peer died or hung).
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)


@dataclass(slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    group: dist.ProcessGroup
    device: torch.device

    @property
    def is_driver(self) -> bool:
        """Rank 0 computes logits, samples, and answers the executor."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks (in place when its dtype allows)."""
        if tensor.dtype in _REDUCE_IN_FP32 and self.device.type == "cpu":
            wide = tensor.float()
            dist.all_reduce(wide, group=self.group)
            return tensor.copy_(wide)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_token_ids(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0 passes its `count` sampled ids; every rank returns them."""
        if self.is_driver:
            assert token_ids is not None and len(token_ids) == count
            buf = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        else:
            buf = torch.empty(count, dtype=torch.int64, device=self.device)
        dist.broadcast(buf, src=0, group=self.group)
        return token_ids if token_ids is not None else buf.tolist()


def create_store(world_size: int, path: str) -> FileStore:
    """The rendezvous store: a file every rank opens (in the executor's private directory).

    Not a TCPStore: that listens on every interface for the engine's lifetime, whatever host
    it is given; a file is reachable only by this user's processes, and needs no port.
    """
    return FileStore(path, world_size)


def join_group(
    rank: int, world_size: int, store: Store, device: torch.device
) -> TensorParallelGroup:
    """Join the process group: NCCL between GPUs, gloo between CPU processes."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    group = dist.group.WORLD
    assert group is not None
    return TensorParallelGroup(rank=rank, world_size=world_size, group=group, device=device)
