"""Host-to-device copies that never wait for the GPU."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`. On CUDA through pinned memory, without waiting: a copy from
    pageable memory first waits for everything already queued on the stream (a host sync in
    the middle of a step). torch's pinned-memory cache keeps the staging block alive until
    the copy has run."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
