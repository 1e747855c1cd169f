"""Worker: owns a device, the model runner and the KV cache memory (of one TP rank)."""

from __future__ import annotations

import logging
import os

import torch

from asyncengine.config import CacheConfig, DeviceConfig, ModelConfig
from asyncengine.sched.output import ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.model_runner import ModelRunner
from asyncengine.worker.parallel import TensorParallelGroup

logger = logging.getLogger(__name__)

# On CUDA without an explicit size, the KV cache takes this share of the memory left free
# once the model is loaded.
_CUDA_FREE_MEMORY_FRACTION = 0.85


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        tp: TensorParallelGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.rank = tp.rank if tp is not None else 0
        self.device = device if device is not None else torch.device(device_config.device)
        torch.manual_seed(model_config.seed)
        self.model_runner = ModelRunner(model_config, cache_config, self.device, tp)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: the configured count, or the byte budget divided up."""
        cc = self.cache_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = self.model_runner.kv_cache_bytes_per_block()
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * _CUDA_FREE_MEMORY_FRACTION)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no KV block: one block of "
                f"{self.cache_config.block_size} tokens takes {per_block} bytes for this model"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.cache_config.block_size,
            num_blocks * self.model_runner.kv_cache_bytes_per_block() / 2**20,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()
