"""Worker: owns a device, the model runner and the KV cache memory (of one TP rank)."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from asyncengine.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from asyncengine.heap import release_free_heap
from asyncengine.ipc.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from asyncengine.worker import gpu_memory
from asyncengine.worker.extension import UnencodableResultError
from asyncengine.worker.model_runner import ModelRunner
from asyncengine.worker.parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        tp: TensorParallelGroup | None = None,
        device: torch.device | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.rank = tp.rank if tp is not None else 0
        self.device = device if device is not None else torch.device(device_config.device)
        # On CUDA: the card's memory before this worker loads anything (worker/gpu_memory.py).
        self._memory_baseline: gpu_memory.MemorySnapshot | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._memory_baseline = gpu_memory.snapshot(self.device)
        torch.manual_seed(model_config.seed)
        self.model_runner = ModelRunner(
            model_config, cache_config, self.device, tp, scheduler_config
        )
        self._num_kv_blocks = 0
        self._sleep_level = 0  # 0: awake; 1: KV cache released; 2: the weights too
        self._profiler: tuple[torch.profiler.profile, str] | None = None  # and its trace path

    def load_model(self) -> None:
        self.model_runner.load_model()

    def enable_lora(self, max_loaded: int, max_lora_rank: int) -> None:
        """Take LoRA adapters from now on (model_runner.enable_lora)."""
        self.model_runner.enable_lora(max_loaded, max_lora_rank)

    def add_lora(self, name: str, path: str) -> None:
        """Register and load a LoRA adapter (model_runner.add_lora)."""
        self.model_runner.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.model_runner.remove_lora(name)

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: the configured count, or the byte budget divided up; on
        CUDA without either, what `gpu_memory_utilization` leaves after a profiling forward.

        On CUDA the profiling forward always runs: it is also the warm-up that compiles the
        prefill path's kernels before the first request."""
        cc = self.cache_config
        baseline = self._memory_baseline
        if baseline is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.model_runner.profile_run()
            peak = torch.cuda.max_memory_allocated(self.device)
            after_profile = gpu_memory.snapshot(self.device)
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = self.model_runner.kv_cache_bytes_per_block()
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            if baseline is None:
                raise ValueError("give kv_cache_memory_bytes or num_kv_blocks off CUDA")
            budget = gpu_memory.kv_cache_budget(
                baseline, after_profile, peak, cc.gpu_memory_utilization
            )
            # The decode graphs are captured after the cache, in a memory pool of their own.
            graphs = self.model_runner.decode_graph_memory()
            logger.info(
                "GPU memory: %.2f GiB of %.2f GiB is this engine's; the KV cache gets %.2f GiB "
                "(peak of the largest step %.2f GiB, decode graphs about %.2f GiB)",
                baseline.total * cc.gpu_memory_utilization / 2**30,
                baseline.total / 2**30,
                (budget - graphs) / 2**30,
                (peak - baseline.torch_allocated) / 2**30,
                graphs / 2**30,
            )
            budget -= graphs
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no KV block: one block of "
                f"{self.cache_config.block_size} tokens takes {per_block} bytes for this model"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._num_kv_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.cache_config.block_size,
            num_blocks * self.model_runner.kv_cache_bytes_per_block() / 2**20,
        )

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: Callable[[], GrammarBitmask | None] | None = None,
    ) -> ModelRunnerOutput:
        """One step. `grammar_bitmask` (in-process only): waits for, and gives, the step's
        bitmask when it is computed beside the forward pass."""
        return self.model_runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        """Before the model's memory goes: wait for the native work pool's helpers to leave
        their items (one preempted inside an item may still read its weights)."""
        from asyncengine.kernels.linear_cpu import quiesce_pool

        quiesce_pool()

    def check_health(self) -> None:
        return None

    def sleep(self, level: int) -> None:
        """Release the KV cache's memory (level 1), and the weights too (level 2); the
        caller has no request running. `wake_up()` restores both."""
        runner = self.model_runner
        runner.kv_caches = []
        runner.decode_graphs = None  # their memory pool, and their hold on the cache
        if level >= 2:
            runner.model = None
        self._sleep_level = max(self._sleep_level, level)
        _release_memory(self.device)

    def wake_up(self) -> None:
        """Reload what `sleep()` released: the weights from the model folder, then a zeroed
        KV cache of the same size."""
        if self._sleep_level >= 2:
            self.model_runner.load_model()
        if self._sleep_level >= 1:
            self.model_runner.initialize_kv_cache(self._num_kv_blocks)
        self._sleep_level = 0

    def pid(self) -> int:
        return os.getpid()

    def call_extension(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """`collective_rpc`'s way in (the core has checked that `method` is callable): its
        result as msgpack gives it back (UnencodableResultError, a TypeError, if it can't)."""
        result = getattr(self, method)(*args, **kwargs)
        try:
            return msgspec.msgpack.decode(msgspec.msgpack.encode(result))
        except (TypeError, msgspec.EncodeError) as exc:
            raise UnencodableResultError(
                f"collective_rpc({method!r}): worker rank {self.rank} returned a "
                f"{type(result).__name__}, which msgspec cannot encode: {exc}"
            ) from None

    def start_profile(self, profile_dir: str, data_parallel_rank: int = 0) -> None:
        """Start torch.profiler; `stop_profile()` writes the chrome trace into `profile_dir`."""
        if self._profiler is not None:
            raise RuntimeError("a profile is already running: stop_profile() first")
        os.makedirs(profile_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        name = f"dp{data_parallel_rank}-tp{self.rank}.{time.time_ns()}.pt.trace.json"
        # One profile object per start: keep all its events (without acc_events some torch
        # versions warn, at a later profile in the process, that a cycle's events are cleared).
        profiler = torch.profiler.profile(activities=activities, acc_events=True)
        profiler.start()
        self._profiler = (profiler, os.path.join(profile_dir, name))

    def stop_profile(self) -> str:
        """Stop the profile `start_profile()` started; the trace file's path."""
        if self._profiler is None:
            raise RuntimeError("no profile is running: start_profile() first")
        (profiler, path), self._profiler = self._profiler, None
        profiler.stop()
        profiler.export_chrome_trace(path)
        return path


def _release_memory(device: torch.device) -> None:
    """Hand freed memory back to the system, not only to the allocators."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    release_free_heap()  # glibc keeps freed heap pages resident otherwise
