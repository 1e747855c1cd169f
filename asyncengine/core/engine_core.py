"""EngineCore: the step loop's body — schedule, execute, update.

EngineCoreRequest → Scheduler.schedule() → Executor.execute_model() →
Scheduler.update_from_output() → EngineCoreOutputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.core.cpu_threads import ThreadGovernor, fixed_threads
from asyncengine.executor.factory import executor_class
from asyncengine.ipc.messages import CoreLoad, EngineCoreOutputs, EngineCoreRequest, EngineStats
from asyncengine.lora.peft_folder import check_peft_folder
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.lora_slots import LoRASlots
from asyncengine.sched.scheduler import Scheduler
from asyncengine.sched.structured_outputs import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long an idle step waits for a compiling grammar before it looks at its inputs again.
_GRAMMAR_WAIT_S = 0.01


def import_model_code(config: EngineConfig, *, owns_process: bool) -> None:
    """Import the model code that EngineCore(config) will run in this process, cheaply.

    Most of an engine's start-up is importing torch and transformers; the executor knows
    what runs in this process (`Executor.import_model_code`). `owns_process`: this process is
    the engine's own (the spawned core), not an application's.
    """
    executor_class(config).import_model_code(config, owns_process=owns_process)


class EngineCore:
    """Owns the scheduler and the executor; `step()` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        # A user's num_threads on CPU, held around everything that computes on this thread.
        self._threads = _user_threads(config)
        with fixed_threads(self._threads):
            self._build(config)
        logger.info("engine core ready in %.2f s", time.monotonic() - start)

    def _build(self, config: EngineConfig) -> None:
        self.executor = executor_class(config)(config)
        try:
            num_blocks = self.executor.determine_num_kv_blocks()
            self.executor.initialize_kv_cache(num_blocks)
            lora = config.lora_config
            if lora.enable_lora:  # ValueError where the model cannot take adapters
                self.executor.collective_rpc(
                    "enable_lora", args=(lora.loaded_limit, lora.max_lora_rank)
                )
        except BaseException:
            self.executor.shutdown()
            raise
        self.config = config.replace_cache(num_kv_blocks=num_blocks)
        cache, model = self.config.cache_config, self.config.model_config
        self.scheduler = Scheduler(
            self.config.scheduler_config,
            KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching),
            model.eos_token_ids,
            model.vocab_size,
            StructuredOutputManager(model.model, model.vocab_size, model.eos_token_ids),
        )
        self._governor = _thread_governor(self.config)
        # LoRA adapters by name (their folders); those removed while requests still use them
        # stay loaded in the workers until the requests finish.
        self.loras: dict[str, str] = {}
        self._loras_to_release: set[str] = set()
        if config.lora_config.enable_lora:
            self.scheduler.lora_slots = LoRASlots(config.lora_config.max_loras)
        # An executor that fills grammar bitmasks beside the forward pass gets them deferred.
        self.scheduler.defer_grammar_fill = self.executor.overlaps_grammar_fill

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (for its sender only) when it cannot be served."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests; the ids that were live."""
        aborted = self.scheduler.abort_requests(request_ids)
        if self._loras_to_release:  # a removed adapter's last request may be among them
            self._release_loras()
        return aborted

    def step(self) -> EngineCoreOutputs:
        """Run one batch: 1. schedule, 2. execute, 3. fold the sampled tokens back in."""
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        if self._governor is not None:
            self._governor.tick()  # compute threads: what other processes leave free
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # Nothing can run until a grammar compiles: wait for it here, not in a spin.
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        start = time.perf_counter()
        # A grammar bitmask left to the executor (computed beside the forward pass), or None.
        grammar_fill = self.scheduler.take_grammar_fill()
        with fixed_threads(self._threads):
            runner_output = self.executor.execute_model(scheduler_output, grammar_fill)
        self.scheduler.record_step_time(scheduler_output, time.perf_counter() - start)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        if self._loras_to_release:
            self._release_loras()
        return outputs

    # ---- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> bool:
        """Load a LoRA adapter from its PEFT folder under `name`; False if the engine holds it
        from that folder already. ValueError for a bad folder (lora/peft_folder.py), an
        engine without `enable_lora`, or a name held from another folder."""
        lora = self.config.lora_config
        if not lora.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        held = self.loras.get(name)
        if held == path:
            return False
        if held is not None:
            raise ValueError(
                f"LoRA adapter {name!r} is loaded from {held} already: remove_lora it first"
            )
        if name in self._loras_to_release:
            raise ValueError(
                f"LoRA adapter {name!r} is being removed and requests still use it: add it "
                "again once they finish"
            )
        check_peft_folder(name, path, self.config.model_config, lora.max_lora_rank)
        self.executor.collective_rpc("add_lora", args=(name, path))
        self.loras[name] = path
        assert self.scheduler.lora_slots is not None
        self.scheduler.lora_slots.register(name, path)
        return True

    def remove_lora(self, name: str) -> None:
        """Stop taking requests for adapter `name`; the ones in flight finish with it, then it
        is unloaded. ValueError for a name the engine does not hold."""
        if name not in self.loras:
            known = ", ".join(sorted(self.loras)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}: the engine holds {known}")
        del self.loras[name]
        assert self.scheduler.lora_slots is not None
        self.scheduler.lora_slots.unregister(name)
        self._loras_to_release.add(name)
        self._release_loras()

    def list_loras(self) -> list[tuple[str, str]]:
        """The adapters the engine holds: (name, folder), by name."""
        return sorted(self.loras.items())

    def _release_loras(self) -> None:
        slots = self.scheduler.lora_slots
        assert slots is not None
        for name in list(self._loras_to_release):
            if not slots.in_use(name, self.scheduler.requests.values()):
                self.executor.collective_rpc("remove_lora", args=(name,))
                self._loras_to_release.discard(name)

    def statistics(self) -> EngineStats:
        """A frozen snapshot: queues, KV blocks, prefix-cache hits."""
        return self.scheduler.statistics()

    def load(self) -> CoreLoad:
        """Waiting and running requests and KV usage now (cheap: after every step)."""
        scheduler = self.scheduler
        return CoreLoad(
            len(scheduler.waiting), len(scheduler.running), scheduler.kv_cache_manager.usage
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (blocks in use stay allocated); returns True."""
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Release the workers' KV cache (level 1) and weights (level 2). No request may be
        in the core; the prefix cache is forgotten (the KV contents are gone)."""
        if self.scheduler.has_requests():
            raise RuntimeError("the engine core cannot sleep with requests in it")
        self.scheduler.reset_prefix_cache()
        self.executor.collective_rpc("sleep", args=(level,))

    def wake_up(self) -> None:
        """Restore what `sleep()` released."""
        self.executor.collective_rpc("wake_up")

    def collective_rpc(
        self,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> list[Any]:
        """A worker extension's `method` on every worker: one result each, in TP rank order.

        ValueError unless `method` is the extension's (or allowlisted); TimeoutError past
        `timeout` (worker processes only: the call is abandoned, the workers finish it before
        their next step); TypeError when a result can't be encoded; RuntimeError with the
        worker's error when the method raises."""
        return self.executor.call_extension(method, args, kwargs, timeout)

    def start_profile(self, profile_dir: str) -> None:
        """torch.profiler on every worker, until `stop_profile()` writes the traces."""
        rank = self.config.parallel_config.data_parallel_rank
        self.executor.collective_rpc("start_profile", args=(profile_dir, rank))

    def stop_profile(self) -> list[str]:
        """Stop every worker's profile; the trace files written, in TP rank order."""
        return [str(path) for path in self.executor.collective_rpc("stop_profile")]

    def shutdown(self) -> None:
        try:
            self.executor.shutdown()
        finally:
            if self.scheduler.structured_outputs is not None:
                self.scheduler.structured_outputs.shutdown()


def _user_threads(config: EngineConfig) -> int | None:
    """The user's `num_threads` where the model computes on CPU, else None."""
    if config.device_config.device != "cpu":
        return None
    return config.parallel_config.num_threads


def _thread_governor(config: EngineConfig) -> ThreadGovernor | None:
    """A ThreadGovernor where the model runs in this process on the CPU with threads of its
    own choosing (not with tensor parallelism, nor a user's `num_threads`)."""
    parallel = config.parallel_config
    if (
        config.device_config.device != "cpu"
        or parallel.tensor_parallel_size != 1
        or parallel.num_threads is not None
    ):
        return None
    import torch

    return ThreadGovernor(torch.get_num_threads())
