"""EngineConfig: each sub-config refuses a bad field when it is built, the whole config refuses
settings that can't go together, an unknown keyword names the one meant, and the server's
queue bound is split exactly across its API servers. Only config.json files: no model loads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncengine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

pytestmark = pytest.mark.timeout(30)

LLAMA_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SHAPE))
    return tmp_path


def _model(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        model="m", architecture="LlamaForCausalLM", dtype="float32", max_model_len=256,
        vocab_size=128, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        hidden_size=64, eos_token_ids=(2,), seed=0, intermediate_size=96,
        attention_backend="torch", max_position_embeddings=256,
    )  # fmt: skip
    return ModelConfig(**{**fields, **changes})


def _cache(**changes: Any) -> CacheConfig:
    fields: dict[str, Any] = dict(
        block_size=16, num_kv_blocks=None, kv_cache_memory_bytes=None, enable_prefix_caching=True
    )
    return CacheConfig(**{**fields, **changes})


def _scheduler(**changes: Any) -> SchedulerConfig:
    fields: dict[str, Any] = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, policy="fcfs"
    )
    return SchedulerConfig(**{**fields, **changes})


def _engine(**changes: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(
        model_config=_model(),
        cache_config=_cache(),
        scheduler_config=_scheduler(),
        device_config=DeviceConfig("cpu"),
    )
    return EngineConfig(**{**fields, **changes})


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: _model(dtype="int8"), r"dtype='int8' is invalid: .*float32"),
        (lambda: _model(dtype="auto"), r"dtype='auto' is unresolved"),
        (lambda: _model(max_model_len=0), r"max_model_len=0 is invalid"),
        (lambda: _model(max_model_len=512), r"larger than the model's max_position_embeddings"),
        (lambda: _model(seed=-1), r"seed=-1 is invalid"),
        (lambda: _model(attention_backend="flash"), r"attention_backend='flash' is invalid"),
        (lambda: _cache(block_size=12), r"block_size=12 is invalid: must be a power of two"),
        (lambda: _cache(block_size=0), r"block_size=0 is invalid"),
        (lambda: _cache(num_kv_blocks=0), r"num_kv_blocks=0 is invalid"),
        (lambda: _cache(num_kv_blocks=4, kv_cache_memory_bytes=10), r"at most one of"),
        (lambda: _cache(enable_prefix_caching=1), r"enable_prefix_caching=1: must be True"),
        (lambda: _scheduler(max_num_seqs=0), r"max_num_seqs=0 is invalid"),
        (lambda: _scheduler(max_num_batched_tokens=True), r"max_num_batched_tokens=True"),
        (lambda: _scheduler(policy="lifo"), r"scheduling_policy='lifo' .*fcfs, priority, sjf"),
        (lambda: DeviceConfig("tpu"), r"device='tpu' is invalid: must be one of auto, cpu"),
        (lambda: DeviceConfig("auto"), r"device='auto' is unresolved"),
        (lambda: ParallelConfig(tensor_parallel_size=0), r"tensor_parallel_size=0 is invalid"),
        (lambda: ParallelConfig(tensor_parallel_size=2), r"'uni' runs one worker"),
        (lambda: ParallelConfig(data_parallel_size=0), r"data_parallel_size=0 is invalid"),
        (
            lambda: ParallelConfig(data_parallel_size=2, data_parallel_rank=2),
            r"data_parallel_rank=2 is invalid: must be in \[0, 2\)",
        ),
        (lambda: ParallelConfig(data_parallel_backend="k8s"), r"data_parallel_backend='k8s'"),
        (lambda: ParallelConfig(data_parallel_routing="x"), r"data_parallel_routing='x'"),
        (lambda: ParallelConfig(data_parallel_placement="x"), r"data_parallel_placement='x'"),
        (lambda: ParallelConfig(data_parallel_fail_fast=None), r"data_parallel_fail_fast=None"),
        (lambda: ParallelConfig(num_threads=0), r"num_threads=0 is invalid"),
        (lambda: FrontendConfig(max_queued_requests=0), r"max_queued_requests=0 is invalid"),
        (lambda: FrontendConfig(api_server_count=0), r"api_server_count=0 is invalid"),
        (
            lambda: FrontendConfig(api_server_count=2, api_server_index=2),
            r"api_server_index=2 is invalid: must be in \[0, 2\)",
        ),
        (
            lambda: FrontendConfig(max_queued_requests=2, api_server_count=3),
            r"max_queued_requests=2 is invalid: must be >= api_server_count \(3\)",
        ),
    ],
)
def test_a_sub_config_refuses_a_bad_field_when_built(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {
                "model_config": _model(attention_backend="cpu"),
                "device_config": DeviceConfig("cuda"),
            },
            r"attention_backend='cpu' runs on CPU devices only, not 'cuda'",
        ),
        (
            {"parallel_config": ParallelConfig(3, "mp")},
            r"tensor_parallel_size=3 does not divide the model's attention heads \(4\)",
        ),
        (
            {"parallel_config": ParallelConfig(4, "mp")},
            r"tensor_parallel_size=4 does not divide the model's KV heads \(2\)",
        ),
        ({"scheduler_config": _scheduler(max_model_len=128)}, r"max_model_len \(128\) differs"),
        ({"step_timeout": 0}, r"step_timeout=0 is invalid"),
        ({"step_timeout": float("inf")}, r"step_timeout=inf is invalid"),
        ({"step_timeout": True}, r"step_timeout=True is invalid"),
    ],
)
def test_the_engine_config_refuses_settings_that_cannot_go_together(
    changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _engine(**changes)


def test_the_parts_of_a_good_config_combine() -> None:
    config = _engine(parallel_config=ParallelConfig(2, "mp"), step_timeout=5)
    assert config.step_timeout == 5.0 and isinstance(config.step_timeout, float)


def test_data_parallel_needs_a_core_of_its_own_process() -> None:
    config = _engine(parallel_config=ParallelConfig(data_parallel_size=2))
    config.check_core_kind("process")
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs core='process'"):
        config.check_core_kind("thread")
    with pytest.raises(ValueError, match=r"data_parallel_size=2: the offline LLM"):
        config.check_core_kind("inline")
    for core in ("process", "thread", "inline"):
        _engine().check_core_kind(core)


def test_from_kwargs_resolves_and_maps_the_keywords(model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(model_dir, device="cpu", max_queued_requests=7)
    assert config.device_config.device == "cpu"
    assert config.model_config.dtype == "float32"  # config.json declares none
    assert config.model_config.max_model_len == config.scheduler_config.max_model_len == 256
    assert config.model_config.attention_backend == "cpu"
    assert config.cache_config.kv_cache_memory_bytes == 256 * 1024**2  # the CPU default
    assert config.parallel_config.distributed_executor_backend == "uni"
    assert config.frontend_config == FrontendConfig(max_queued_requests=7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, r"dtype='int8' is invalid: must be one of auto, float32"),
        ({"device": "tpu"}, r"device='tpu' is invalid"),
        ({"max_model_len": 10**6}, r"max_model_len=1000000 is larger than"),
        ({"max_queued_requests": 0}, r"max_queued_requests=0 is invalid"),
        ({"tensor_parallel_size": 3}, r"does not divide the model's attention heads"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, r"'uni' runs one"),
        ({"device": "cuda", "attention_backend": "cpu"}, r"runs on CPU devices only"),
        ({"step_timeout": "soon"}, r"step_timeout='soon' is invalid"),
    ],
)
def test_from_kwargs_reports_what_the_sub_configs_refuse(
    model_dir: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(model_dir, **kwargs)


def test_an_unknown_keyword_names_the_one_meant(model_dir: Path) -> None:
    with pytest.raises(TypeError) as info:
        EngineConfig.from_kwargs(model_dir, max_num_seq=4)
    assert str(info.value) == (
        "LLM() / AsyncLLM.from_pretrained() got an unexpected keyword 'max_num_seq': "
        "did you mean 'max_num_seqs'?"
    )
    with pytest.raises(TypeError, match=r"unexpected keyword 'frobnicate': it takes dtype, "):
        EngineConfig.from_kwargs(model_dir, frobnicate=True)


@pytest.mark.parametrize(("total", "count"), [(1, 1), (7, 3), (4096, 3), (5, 5), (10, 4)])
def test_the_queue_bound_is_split_exactly_across_the_api_servers(total: int, count: int) -> None:
    config = _engine(frontend_config=FrontendConfig(max_queued_requests=total))
    shares = [
        config.for_api_server(i, count).frontend_config.local_max_queued_requests
        for i in range(count)
    ]
    assert sum(shares) == total  # the documented bound holds for the whole server
    assert max(shares) - min(shares) <= 1 and min(shares) >= 1


def test_an_api_server_names_its_share_of_the_bound() -> None:
    one = FrontendConfig(max_queued_requests=10)
    assert one.describe_queue_bound() == "max_queued_requests=10"
    third = dataclasses.replace(one, api_server_count=3, api_server_index=2)
    assert (
        third.describe_queue_bound() == "max_queued_requests=10 over 3 API servers: 3 in this one"
    )


def test_each_api_server_gets_its_share_over_the_wire() -> None:
    """The manager hands each API server its config as msgpack (APIServerLaunch)."""
    config = _engine(frontend_config=FrontendConfig(max_queued_requests=5)).for_api_server(0, 2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert decoded == config
    assert decoded.frontend_config.local_max_queued_requests == 3


def test_the_manager_splits_the_bound_before_anything_starts() -> None:
    from asyncengine.entrypoints.api_server_manager import APIServerProcessManager
    from asyncengine.entrypoints.openai.api_server_proc import ServerOptions

    options = ServerOptions("m", None, 1 << 20, None, 1.0, "info", False, "127.0.0.1", 0)
    config = _engine(frontend_config=FrontendConfig(max_queued_requests=7))
    manager = APIServerProcessManager(config, options, api_server_count=3)
    shares = [c.frontend_config.local_max_queued_requests for c in manager.server_configs]
    assert shares == [3, 2, 2]
    with pytest.raises(ValueError, match=r"max_queued_requests=7 is invalid: must be >= api_ser"):
        APIServerProcessManager(config, options, api_server_count=8)


def test_a_profiled_block_count_replaces_the_byte_budget() -> None:
    config = _engine(cache_config=_cache(kv_cache_memory_bytes=1 << 20))
    fixed = config.replace_cache(num_kv_blocks=12)
    assert (fixed.cache_config.num_kv_blocks, fixed.cache_config.kv_cache_memory_bytes) == (
        12,
        None,
    )
