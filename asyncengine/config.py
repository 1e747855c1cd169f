"""EngineConfig: every engine setting in one frozen object, split into per-component parts.

Built from the keyword arguments that `LLM(...)` and `AsyncLLM.from_pretrained(...)` accept.
It reads the model's `config.json` with the json module only: the client side never imports
torch or transformers' model code.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncengine.default_model import resolve_model
from asyncengine.gguf.serving import is_gguf_file
from asyncengine.gpus import resolve_device, visible_gpus
from asyncengine.lora.request import LoRAConfig
from asyncengine.model_files import (
    architecture,
    eos_token_ids,
    model_len_limit,
    read_generation_config,
    read_hf_config,
    sampling_defaults,
)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_POLICIES = ("fcfs", "priority", "sjf")
_EXECUTOR_BACKENDS = ("uni", "mp")
_ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
_DP_BACKENDS = ("mp", "ray")
_DP_ROUTINGS = ("prefix", "load", "round_robin")
_DP_PLACEMENTS = ("spread", "pack")
_CPU_DEFAULT_KV_BYTES = 256 * 1024**2
# The default token budget of a step, for serving (AsyncLLM). On CPUs a 2,048-token prefill
# step of a 135M model takes ~0.5 s, and every request admitted in it waits that long for its
# first token: 1,024 cuts the median wait of 64 concurrent SmolLM2 requests from 1.14-1.26 to
# 0.86-0.96 s. Offline batches (`LLM`) keep 2,048 (OFFLINE_MAX_NUM_BATCHED_TOKENS): no one
# waits on a first token there, and fewer, larger steps measured up to ~8% faster on SmolLM2.
_DEFAULT_BATCHED_TOKENS = {"cpu": 1024, "cuda": 2048}
# On CPUs a prefill step is compute: its time is its tokens times the layers' weights, and it
# is a stall for every running stream too. The CPU budget shrinks (by halves, to at most
# _CPU_STEP_WEIGHT_TOKENS weight x tokens, never below _CPU_MIN_BATCHED_TOKENS) for larger
# models, so that a step takes about as long as a 1,024-token step of a ~250M model. On
# Qwen2.5-0.5B's shapes (358M weights in the layers: 512 tokens), 64 concurrent requests:
# TTFT p50 1.80-1.87 -> 1.60-1.71 s, inter-token p99 0.88-0.90 -> 0.46-0.49 s, same
# throughput. The GEMMs stay at full speed from ~64 rows (measured on 2 Zen 5 cores).
_CPU_STEP_WEIGHT_TOKENS = 2**38
_CPU_MIN_BATCHED_TOKENS = 256
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: must be one of {', '.join(allowed)}")


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")


def _check_resolved(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """One of `allowed` (a keyword's choices, 'auto' first) but not 'auto': a built config
    holds what EngineConfig.from_kwargs resolved it to."""
    _check_choice(name, value, allowed)
    if value == "auto":
        raise ValueError(
            f"{name}='auto' is unresolved: a built config holds one of {', '.join(allowed[1:])}"
        )


def _check_index(name: str, value: object, size: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
        raise ValueError(f"{name}={value!r} is invalid: must be in [0, {size})")


def _check_import_path(name: str, value: object) -> None:
    """None, or "package.module:Class" / "package.module.Class" (imported where it is used)."""
    if value is None:
        return
    if not isinstance(value, str) or not _IMPORT_PATH.fullmatch(value):
        raise ValueError(
            f"{name}={value!r} is invalid: must be an import path, 'package.module:Class' "
            "or 'package.module.Class'"
        )


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")


# What `quantization=` takes: None (the checkpoint's weights as they are) or "int8".
QUANTIZATIONS: tuple[str | None, ...] = (None, "int8")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the worker needs to load and run the model."""

    model: str
    architecture: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    seed: int
    intermediate_size: int | None = None  # the MLP width, when the config names one
    attention_backend: str = "torch"  # resolved: cpu | torch | triton
    # The model's sampling defaults (generation_config.json): they fill what a request leaves
    # unset, as in vLLM. Pairs, sorted, so that the config stays hashable.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # The longest context the model was built for (config.json); None: not known.
    max_position_embeddings: int | None = None
    # CUDA: run every step eagerly, capturing no CUDA graphs for decode steps.
    enforce_eager: bool = False
    # "int8": the checkpoint's linear weights quantized at load (model/quant_linear.py);
    # None: as the checkpoint stores them.
    quantization: str | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        _check_resolved("dtype", self.dtype, _DTYPES)
        _check_int("max_model_len", self.max_model_len, 1)
        limit = self.max_position_embeddings
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings ({limit})"
            )
        _check_int("seed", self.seed, 0)
        _check_resolved("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        _check_bool("enforce_eager", self.enforce_eager)
        if self.quantization not in QUANTIZATIONS:
            allowed = ", ".join(repr(q) for q in QUANTIZATIONS)
            raise ValueError(f"quantization={self.quantization!r} is invalid: one of {allowed}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (or bytes) to allocate."""

    block_size: int
    num_kv_blocks: int | None  # None: derive from kv_cache_memory_bytes / free memory
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    # On CUDA without kv_cache_memory_bytes / num_kv_blocks: the share of the card's total
    # memory this engine may use in all (weights, activations at the largest step, KV cache);
    # the KV cache gets what is left of it after a profiling forward (worker/gpu_memory.py).
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        _check_int("block_size", self.block_size, 1)
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            raise ValueError(
                f"gpu_memory_utilization={gmu!r} is invalid: must be a fraction of the GPU's "
                "memory, greater than 0 and at most 1"
            )
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(
                f"block_size={self.block_size} is invalid: must be a power of two <= 256"
            )
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give at most one of num_kv_blocks and kv_cache_memory_bytes")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)


# What `speculative_config=` takes (docs/speculative.md): the methods, and the most draft
# tokens a step may verify per request.
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """n-gram speculative decoding (vLLM's `speculative_config` names): each decode step
    drafts up to `num_speculative_tokens` tokens from the longest match, of
    `prompt_lookup_min` to `prompt_lookup_max` tokens, of the request's last tokens earlier in
    its own prompt and output, and the model verifies them in the same forward."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        _check_choice("speculative_config method", self.method, SPECULATIVE_METHODS)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k!r} is invalid: must be an "
                f"integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        _check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min, 1)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if (
            not isinstance(high, int)
            or isinstance(high, bool)
            or not low <= high <= MAX_PROMPT_LOOKUP
        ):
            raise ValueError(
                f"speculative_config prompt_lookup_max={high!r} is invalid: must be an integer "
                f"in [prompt_lookup_min ({low}), {MAX_PROMPT_LOOKUP}]"
            )

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """The config of a `speculative_config=` keyword: None (off), a SpeculativeConfig, a
        mapping of its fields or that mapping as a JSON string (the CLI's flag)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config={value!r} is invalid: must be a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(map(repr, unknown))}: "
                f"the fields are {', '.join(fields)}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits and the waiting-queue policy."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str  # fcfs | priority | sjf (sched/request_queue.py)
    speculative: SpeculativeConfig | None = None  # n-gram drafts (sched/spec_decode.py)

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_choice("scheduling_policy", self.policy, _POLICIES)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative={self.speculative!r} must be a SpeculativeConfig")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str  # resolved: cpu | cuda

    def __post_init__(self) -> None:
        """ValueError unless the device is a resolved one."""
        _check_resolved("device", self.device, _DEVICES)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many workers share the model, how many engine cores serve it, and how they run."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # resolved: uni | mp
    # Data parallel: this many engine cores (ranks), each a full core with its own executor.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # which rank this core is (set by the launcher, per rank)
    data_parallel_backend: str = "mp"  # mp: processes here | ray: Ray actors, any node
    data_parallel_routing: str = "prefix"  # prefix | load | round_robin (client/cores/dp_router.py)
    data_parallel_fail_fast: bool = False  # one dead rank kills the engine
    # ray: the placement group's strategy, a rank per node where it can ("spread"), or as
    # few nodes as the ranks fit on ("pack").
    data_parallel_placement: str = "spread"
    # Compute threads of each worker (None: this machine's cores shared among every worker
    # of every rank on it, at least one each).
    num_threads: int | None = None
    # "package.module:Class" (or "package.module.Class"): a class whose methods are mixed
    # into every worker, callable through `collective_rpc` (worker/extension.py).
    worker_extension_cls: str | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        self._check_tensor_parallel()
        self._check_data_parallel()
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        _check_import_path("worker_extension_cls", self.worker_extension_cls)

    def _check_tensor_parallel(self) -> None:
        tp, backend = self.tensor_parallel_size, self.distributed_executor_backend
        _check_int("tensor_parallel_size", tp, 1)
        _check_choice("distributed_executor_backend", backend, _EXECUTOR_BACKENDS)
        if backend == "uni" and tp != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but "
                f"tensor_parallel_size={tp}: use 'mp' for more than one"
            )

    def _check_data_parallel(self) -> None:
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        _check_index("data_parallel_rank", self.data_parallel_rank, self.data_parallel_size)
        _check_choice("data_parallel_backend", self.data_parallel_backend, _DP_BACKENDS)
        _check_choice("data_parallel_routing", self.data_parallel_routing, _DP_ROUTINGS)
        _check_choice("data_parallel_placement", self.data_parallel_placement, _DP_PLACEMENTS)
        _check_bool("data_parallel_fail_fast", self.data_parallel_fail_fast)

    @property
    def workers_per_machine(self) -> int:
        """Workers that share this machine's cores (every rank's, with the mp backend)."""
        ranks_here = self.data_parallel_size if self.data_parallel_backend == "mp" else 1
        return ranks_here * self.tensor_parallel_size

    def threads_per_worker(self) -> int:
        """How many compute threads one worker should use (num_threads, or its share)."""
        if self.num_threads is not None:
            return self.num_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return max(1, (cores or os.cpu_count() or 1) // self.workers_per_machine)


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """The client's own limits (AsyncLLM; with `serve --api-server-count K`, each of the K
    API server processes is one client, and they split the limits between them)."""

    # New requests are refused (EngineOverloadedError, HTTP 503) while this many have produced
    # no output yet (waiting in the core, or in their prefill): the bound of the whole server.
    max_queued_requests: int = 4096
    api_server_count: int = 1  # the clients that share the bound (serve --api-server-count)
    api_server_index: int = 0  # which of them this is

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        _check_int("max_queued_requests", self.max_queued_requests, 1)
        _check_int("api_server_count", self.api_server_count, 1)
        _check_index("api_server_index", self.api_server_index, self.api_server_count)
        if self.max_queued_requests < self.api_server_count:
            raise ValueError(
                f"max_queued_requests={self.max_queued_requests} is invalid: must be >= "
                f"api_server_count ({self.api_server_count}), so that every API server "
                "admits at least one request"
            )

    @property
    def local_max_queued_requests(self) -> int:
        """This API server's share of max_queued_requests: the K shares differ by at most
        one and add up to max_queued_requests exactly, so the whole server never holds more."""
        share, rest = divmod(self.max_queued_requests, self.api_server_count)
        return share + (1 if self.api_server_index < rest else 0)

    def describe_queue_bound(self) -> str:
        """The bound, as an overload error names it."""
        bound = f"max_queued_requests={self.max_queued_requests}"
        if self.api_server_count == 1:
            return bound
        return (
            f"{bound} over {self.api_server_count} API servers: "
            f"{self.local_max_queued_requests} in this one"
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every engine setting; each component receives only its own part.

    Each part checks its own fields when it is built; this checks how they combine."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = ParallelConfig()
    frontend_config: FrontendConfig = FrontendConfig()
    # Multi-LoRA serving (asyncengine/lora/); frozen, so one default instance is safe.
    lora_config: LoRAConfig = LoRAConfig()  # noqa: RUF009
    # A step (or a tensor-parallel collective) that runs longer is a hang: the engine dies
    # loudly instead of waiting forever. Also how long a silent core process is given.
    step_timeout: float = 300.0

    def __post_init__(self) -> None:
        """ValueError naming the fields that can't go together."""
        timeout = self.step_timeout
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not 0 < timeout < float("inf")
        ):
            raise ValueError(f"step_timeout={timeout!r} is invalid: must be seconds > 0")
        object.__setattr__(self, "step_timeout", float(timeout))  # frozen: set once, here
        self._check_combinations()

    def _check_combinations(self) -> None:
        mc, device = self.model_config, self.device_config.device
        if mc.attention_backend == "cpu" and device != "cpu":
            raise ValueError(
                f"attention_backend='cpu' runs on CPU devices only, not {device!r}: "
                "choose 'auto', 'torch' or 'triton'"
            )
        if self.scheduler_config.max_model_len != mc.max_model_len:
            raise ValueError(
                f"the scheduler's max_model_len ({self.scheduler_config.max_model_len}) "
                f"differs from the model's ({mc.max_model_len})"
            )
        _check_tensor_parallel(
            self.parallel_config.tensor_parallel_size,
            mc.num_attention_heads,
            mc.num_kv_heads,
            mc.intermediate_size,
        )

    def check_core_kind(self, core: str) -> None:
        """ValueError when the engine core can't run as `core`: "process" (AsyncLLM's
        default), "thread" (AsyncLLM, in this process) or "inline" (LLMEngine: in the
        caller's thread, behind the offline LLM)."""
        dp = self.parallel_config.data_parallel_size
        if dp == 1:
            return
        if core == "thread":
            raise ValueError(
                f"data_parallel_size={dp} needs core='process': ranks are processes (or Ray actors)"
            )
        if core == "inline":
            raise ValueError(
                f"data_parallel_size={dp}: the offline LLM runs one engine core in this "
                "process; use AsyncLLM or `asyncengine serve` for data parallel"
            )

    @classmethod
    def from_kwargs(
        cls,
        model: str | os.PathLike[str],
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        max_queued_requests: int = 4096,
        step_timeout: float = 300.0,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        attention_backend: str = "auto",
        data_parallel_size: int = 1,
        data_parallel_backend: str = "mp",
        data_parallel_routing: str = "prefix",
        data_parallel_fail_fast: bool = False,
        data_parallel_placement: str = "spread",
        num_threads: int | None = None,
        worker_extension_cls: str | None = None,
        generation_config: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        quantization: str | None = None,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 64,
        **unknown: Any,
    ) -> EngineConfig:
        """The config of the keywords of `LLM(...)` / `AsyncLLM.from_pretrained(...)`.

        Resolves what the keywords leave open ('auto' dtype and device, defaults that depend
        on the model, read from its config.json) and maps them onto the sub-configs, which
        check themselves: ValueError naming the field; TypeError for an unknown keyword."""
        _refuse_unknown_keywords(unknown)
        model_dir = resolve_model(model)
        hf = read_hf_config(model_dir)
        generation = read_generation_config(model_dir, generation_config)
        device_config = DeviceConfig(device=resolve_device(device))
        on = device_config.device
        model_config = _model_config(
            model_dir, hf, generation, generation_config,
            dtype=dtype, device=on, max_model_len=max_model_len, seed=seed,
            attention_backend=attention_backend, enforce_eager=enforce_eager,
            quantization=quantization,
        )  # fmt: skip
        _check_quantization(model_config, tensor_parallel_size)
        if on == "cpu" and num_kv_blocks is None and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = _CPU_DEFAULT_KV_BYTES
        if distributed_executor_backend is None:
            distributed_executor_backend = "uni" if tensor_parallel_size == 1 else "mp"
        config = cls(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=(
                    _default_batched_tokens(on, model_config)
                    if max_num_batched_tokens is None
                    else max_num_batched_tokens
                ),
                max_model_len=model_config.max_model_len,
                policy=scheduling_policy,
                speculative=SpeculativeConfig.from_value(speculative_config),
            ),
            device_config=device_config,
            parallel_config=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend=distributed_executor_backend,
                data_parallel_size=data_parallel_size,
                data_parallel_backend=data_parallel_backend,
                data_parallel_routing=data_parallel_routing,
                data_parallel_fail_fast=data_parallel_fail_fast,
                data_parallel_placement=data_parallel_placement,
                num_threads=num_threads,
                worker_extension_cls=worker_extension_cls,
            ),
            frontend_config=FrontendConfig(max_queued_requests=max_queued_requests),
            lora_config=LoRAConfig(enable_lora, max_loras, max_cpu_loras, max_lora_rank),
            step_timeout=step_timeout,
        )
        if on == "cuda":
            # Here, in the client, before anything starts: not in __post_init__, which runs
            # in every core too, where a Ray actor sees only its own GPUs.
            check_gpu_count(config.parallel_config, visible_gpus())
        return config

    def for_rank(self, rank: int) -> EngineConfig:
        """The config of data-parallel rank `rank`'s engine core."""
        return dataclasses.replace(
            self, parallel_config=dataclasses.replace(self.parallel_config, data_parallel_rank=rank)
        )

    def for_api_server(self, index: int, count: int) -> EngineConfig:
        """The config of API server `index` of `count` (`serve --api-server-count`): its
        front-end admits its share of the server's limits (FrontendConfig)."""
        frontend = dataclasses.replace(
            self.frontend_config, api_server_count=count, api_server_index=index
        )
        return dataclasses.replace(self, frontend_config=frontend)

    def replace_cache(self, **changes: Any) -> EngineConfig:
        """A copy with cache settings changed (the core fixes num_kv_blocks after profiling)."""
        if changes.get("num_kv_blocks") is not None:
            # The byte budget is spent: the block count it bought replaces it.
            changes.setdefault("kv_cache_memory_bytes", None)
        return dataclasses.replace(
            self, cache_config=dataclasses.replace(self.cache_config, **changes)
        )


# The keywords `EngineConfig.from_kwargs` (so `LLM(...)`, `AsyncLLM.from_pretrained(...)`) takes.
ENGINE_KEYWORDS: tuple[str, ...] = tuple(
    name
    for name, param in inspect.signature(EngineConfig.from_kwargs).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
)


def _refuse_unknown_keywords(unknown: dict[str, Any]) -> None:
    """TypeError naming the first unknown keyword, and the accepted one it is closest to."""
    if not unknown:
        return
    name = next(iter(unknown))
    close = difflib.get_close_matches(name, ENGINE_KEYWORDS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(ENGINE_KEYWORDS)}"
    raise TypeError(
        f"LLM() / AsyncLLM.from_pretrained() got an unexpected keyword {name!r}: {hint}"
    )


def _model_config(
    model_dir: Path,
    hf: dict[str, Any],
    generation: dict[str, Any],
    generation_source: str,
    *,
    dtype: str,
    device: str,
    max_model_len: int | None,
    seed: int,
    attention_backend: str,
    enforce_eager: bool = False,
    quantization: str | None = None,
) -> ModelConfig:
    """The model's shapes from its config.json, with the keywords' 'auto' values resolved."""
    len_limit = model_len_limit(hf)
    num_heads = int(hf["num_attention_heads"])
    intermediate = hf.get("intermediate_size")
    return ModelConfig(
        model=str(model_dir),
        architecture=architecture(hf, model_dir),
        dtype=_resolve_dtype(dtype, hf, device),
        max_model_len=len_limit if max_model_len is None else max_model_len,
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        hidden_size=int(hf["hidden_size"]),
        eos_token_ids=eos_token_ids(hf, generation),
        seed=seed,
        intermediate_size=int(intermediate) if isinstance(intermediate, int) else None,
        attention_backend=_resolve_attention_backend(attention_backend, device),
        sampling_defaults=sampling_defaults(generation, generation_source),
        max_position_embeddings=len_limit,
        enforce_eager=enforce_eager,
        quantization=quantization,
    )


def _check_quantization(mc: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError where `quantization` cannot apply: it quantizes a Hugging Face checkpoint
    onto the lean CPU forward's int8 kernels (whether the lean loader takes the checkpoint
    is checked as the model loads: model/loader.py)."""
    if mc.quantization is None:
        return
    where = f"quantization={mc.quantization!r}"
    if is_gguf_file(mc.model):
        raise ValueError(
            f"{where} quantizes a Hugging Face checkpoint's weights; {mc.model} is a GGUF file, "
            "whose weights are quantized already: leave quantization unset"
        )
    if mc.attention_backend != "cpu":
        raise ValueError(
            f"{where} runs on the CPU (device 'cpu', attention backend 'cpu') only; this "
            f"config has attention backend {mc.attention_backend!r}"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"{where} does not run with tensor parallelism (tensor_parallel_size="
            f"{tensor_parallel_size}); use tensor_parallel_size=1, or data parallelism"
        )


def _default_batched_tokens(device: str, mc: ModelConfig) -> int:
    """The serving token budget of a step when none is given (see _CPU_STEP_WEIGHT_TOKENS)."""
    budget = _DEFAULT_BATCHED_TOKENS[device]
    if device != "cpu":
        return budget
    weights = _layer_weights(mc)
    while budget > _CPU_MIN_BATCHED_TOKENS and budget * weights > _CPU_STEP_WEIGHT_TOKENS:
        budget //= 2
    return budget


def _layer_weights(mc: ModelConfig) -> int:
    """About how many weights a token meets in the decoder layers (projections only; the
    embedding and lm_head apart): attention's q, k, v, o and a gated MLP (3 x hidden x
    intermediate; 4 x hidden wide where the config names no width)."""
    hidden, head_dim = mc.hidden_size, mc.head_dim
    intermediate = mc.intermediate_size or 4 * hidden
    attention = 2 * hidden * head_dim * (mc.num_attention_heads + mc.num_kv_heads)
    return mc.num_layers * (attention + 3 * hidden * intermediate)


def _check_tensor_parallel(
    tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None
) -> None:
    """Each rank takes whole attention heads and an equal slice of the MLP."""
    for what, count in (
        ("attention heads", num_heads),
        ("KV heads", num_kv_heads),
        ("MLP intermediate size", intermediate_size),
    ):
        if count is not None and count % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {what} ({count}): "
                f"choose a tensor_parallel_size that divides {count}"
            )


def _resolve_attention_backend(backend: str, device: str) -> str:
    """auto: the Triton kernels on CUDA (when triton is installed, else the torch reference);
    the native kernels on CPU (which fall back to the torch reference where they can't be
    built)."""
    if backend != "auto":
        return backend
    if device != "cuda":
        return "cpu"
    import importlib.util

    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def check_gpu_count(parallel: ParallelConfig, visible: list[str] | None) -> None:
    """ValueError when the engine cores of this machine need more GPUs than are `visible`
    (None: unknown, not checked): with data_parallel_backend="mp" every worker of every rank
    has a GPU of its own here (executor/placement.py). Ray ranks get theirs from the
    cluster, which its placement group checks."""
    if visible is None or parallel.data_parallel_backend != "mp":
        return
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    needed = dp * tp
    if needed <= len(visible):
        return
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"CUDA_VISIBLE_DEVICES={value!r}" if value is not None else "no CUDA_VISIBLE_DEVICES"
    have = f"{len(visible)} {'is' if len(visible) == 1 else 'are'} visible"
    raise ValueError(
        f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {needed} "
        f"GPU{'' if needed == 1 else 's'}, but {have} ({shown}): each worker of each "
        "rank runs on a GPU of its own"
    )


def _resolve_dtype(dtype: str, hf: dict[str, Any], device: str) -> str:
    if dtype != "auto":
        return dtype
    declared = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
    if declared not in ("float32", "bfloat16", "float16"):
        declared = "float32"
    # float16 matmuls are slow on CPUs; bfloat16 has the same memory cost and is fast.
    if device == "cpu" and declared == "float16":
        return "bfloat16"
    return declared
