"""LoRAManager: the worker's LoRA adapters, registered by name, loaded up to a bound (least
recently used unloaded beyond it, and reloaded from their folder when a step needs them
again), and each step's `LoRABatch`.

Unloaded weights are freed only at the next step, after the native work pool's helpers have
left their items (`quiesce_pool`): a helper preempted inside a LoRA item of the step before may
still read an adapter's weights (kernels/csrc/lora.c, pool.c).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from asyncengine.config import ModelConfig
from asyncengine.kernels.linear_cpu import quiesce_pool
from asyncengine.kernels.lora import Rows
from asyncengine.lora.peft_folder import PeftAdapter, check_peft_folder
from asyncengine.model.lora_layers import LoRABatch, LoRAWeights

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by name: every registered one's checked folder, and the loaded ones' weights
    (at most `max_loaded`, in LRU order)."""

    def __init__(
        self, model_config: ModelConfig, max_loaded: int, max_lora_rank: int, dtype: torch.dtype
    ) -> None:
        self.model_config = model_config
        self.max_loaded = max_loaded
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype  # the model's (the adapters' weights are kept in fp32)
        self.adapters: dict[str, PeftAdapter] = {}
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recent first
        self.num_loads = 0  # loads from disk, reloads after an eviction included
        self._retired: list[LoRAWeights] = []  # unloaded, freed at the next step_batch

    def add(self, name: str, path: str) -> None:
        """Register and load an adapter; ValueError for a bad folder (peft_folder.py)."""
        adapter = check_peft_folder(name, path, self.model_config, self.max_lora_rank)
        self.adapters[name] = adapter
        self._retire(self.loaded.pop(name, None))  # a new folder under an old name: anew
        self._load(name)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._retire(self.loaded.pop(name, None))

    def weights(self, name: str) -> LoRAWeights:
        """The adapter's weights, loaded again if they were evicted; now the most recent."""
        weights = self.loaded.get(name)
        if weights is None:
            return self._load(name)
        self.loaded.move_to_end(name)
        return weights

    def step_batch(self, names: list[str | None], counts: list[int]) -> LoRABatch | None:
        """The step's LoRABatch: per request (in batch order) its adapter and how many packed
        rows it has; None when no row uses an adapter."""
        if self._retired:  # the steps that could read them are over: free them
            quiesce_pool()
            self._retired.clear()
        if all(n is None for n in names):
            return None
        starts = np.cumsum([0, *counts[:-1]]).tolist()
        spans: dict[str, list[tuple[int, int]]] = {}
        for name, start, count in zip(names, starts, counts, strict=True):
            if name is None:
                continue
            parts = spans.setdefault(name, [])
            if parts and parts[-1][1] == start:  # side by side with the one before: merged
                parts[-1] = (parts[-1][0], start + count)
            else:
                parts.append((start, start + count))
        return LoRABatch([(self.weights(n), _rows(parts)) for n, parts in spans.items()])

    def _load(self, name: str) -> LoRAWeights:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        weights = LoRAWeights.load(adapter)
        # The native decode call's layout, its weights bf16 for a bf16 model (which is what it
        # runs), else the fp32 ones themselves.
        native_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        weights.build_native(self.model_config.num_layers, native_dtype)
        self.num_loads += 1
        self.loaded[name] = weights
        while len(self.loaded) > self.max_loaded:
            evicted, old = self.loaded.popitem(last=False)
            self._retire(old)
            logger.info("LoRA adapter %r unloaded (max_cpu_loras=%d)", evicted, self.max_loaded)
        return weights

    def _retire(self, weights: LoRAWeights | None) -> None:
        if weights is not None:
            self._retired.append(weights)


def _rows(spans: list[tuple[int, int]]) -> Rows:
    """One adapter's packed rows: a slice for one contiguous span, else their indices."""
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.from_numpy(np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in spans]))
