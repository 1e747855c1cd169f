"""MultiprocExecutor: tensor-parallel workers give transformers' greedy tokens; calls to the
workers answer, fail loudly, or time out; nothing is left behind."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.executor.factory import executor_class
from asyncengine.executor.multiproc import MultiprocExecutor, WorkerError
from asyncengine.executor.uniproc import UniProcExecutor
from asyncengine.executor.worker_proc import LOG_LEVEL_ENV
from asyncengine.testing import transformers_greedy
from asyncengine.testing.fault_injection import ENV as HOOKS_ENV

pytestmark = pytest.mark.timeout(180)

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = [1, 9, 17, 40, 90, 150]
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]
    return [*prompts, [*prompts[4][:70], 11, 12]]  # a prefix-cache hit on a full block


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_greedy_equals_tp1_and_transformers(
    arch: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = _prompts()
    expected = transformers_greedy(model_dir, prompts, NEW_TOKENS)

    results = {}
    for tp in (1, 2):
        # A small token budget also chunks the longer prefills across steps.
        llm = LLM(
            model_dir,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            max_num_batched_tokens=64,
        )
        try:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            results[tp] = [o.outputs[0].token_ids for o in outs]
            stats = llm.statistics()
            assert stats.num_free_kv_blocks == stats.num_kv_blocks
        finally:
            llm.shutdown()
    assert results[1] == expected
    assert results[2] == expected


def test_tp_size_must_divide_the_heads(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*attention heads \(4\)"):
        EngineConfig.from_kwargs(model_dir, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*KV heads \(2\)"):
        EngineConfig.from_kwargs(model_dir, device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig.from_kwargs(
            model_dir, device="cpu", tensor_parallel_size=2, distributed_executor_backend="x"
        )
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        EngineConfig.from_kwargs(
            model_dir, device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni"
        )


def test_backend_defaults_follow_the_tp_size(tiny_llama: Path) -> None:
    one = EngineConfig.from_kwargs(tiny_llama, device="cpu")
    two = EngineConfig.from_kwargs(tiny_llama, device="cpu", tensor_parallel_size=2)
    forced = EngineConfig.from_kwargs(tiny_llama, device="cpu", distributed_executor_backend="mp")
    assert one.parallel_config.distributed_executor_backend == "uni"
    assert executor_class(one) is UniProcExecutor
    assert two.parallel_config.distributed_executor_backend == "mp"
    assert executor_class(two) is MultiprocExecutor
    assert executor_class(forced) is MultiprocExecutor  # one worker, in its own process


@pytest.fixture(scope="module")
def executor(tiny_model_factory: Callable[..., Path]) -> Iterator[MultiprocExecutor]:
    # Workers inherit the environment at spawn: enable their fault-injection methods.
    name, module = HOOKS_ENV
    old = os.environ.get(name)
    os.environ[name] = module
    config = EngineConfig.from_kwargs(
        tiny_model_factory("llama"),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=64,
    )
    ex = MultiprocExecutor(config)
    try:
        yield ex
    finally:
        ex.shutdown()
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def test_collective_rpc_answers_once_per_rank_in_order(executor: MultiprocExecutor) -> None:
    pids = executor.collective_rpc("pid")
    assert pids == [p.pid for p in executor._procs]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert executor.determine_num_kv_blocks() == 64
    executor.check_health()


def test_collective_rpc_timeout_names_the_method(executor: MultiprocExecutor) -> None:
    with pytest.raises(TimeoutError, match="testing_sleep"):
        executor.collective_rpc("testing_sleep", args=(1.0,), timeout=0.2)
    # The late answers of the timed-out call are dropped; the next call gets its own.
    assert len(executor.collective_rpc("pid", timeout=10)) == 2


def test_an_exception_in_a_worker_reaches_the_caller_with_its_traceback(
    executor: MultiprocExecutor,
) -> None:
    with pytest.raises(WorkerError, match="no method 'no_such_method'") as info:
        executor.collective_rpc("no_such_method", timeout=10)
    assert "worker traceback" in str(info.value)
    with pytest.raises(WorkerError, match=r"worker rank \d failed: \w+Error") as info:
        executor.collective_rpc("initialize_kv_cache", args=(-1,), timeout=10)
    assert "Traceback (most recent call last)" in str(info.value)
    # A failed call leaves the workers serving.
    assert len(executor.collective_rpc("pid", timeout=10)) == 2


def test_shutdown_stops_every_worker_and_logs_name_the_rank(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "INFO")  # workers log their KV cache size at INFO
    config = EngineConfig.from_kwargs(
        tiny_llama, device="cpu", tensor_parallel_size=2, num_kv_blocks=16
    )
    ex = MultiprocExecutor(config)
    procs = [psutil.Process(p.pid) for p in ex._procs if p.pid is not None]
    ex.initialize_kv_cache(16)
    ex.shutdown()
    err = capfd.readouterr().err
    for rank, proc in enumerate(procs):
        assert f"(worker rank={rank} pid={proc.pid}) INFO" in err
    ex.shutdown()  # idempotent
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs)
    assert not ex.is_failed  # an orderly shutdown is not a failure


def test_execute_model_of_an_empty_step(executor: MultiprocExecutor) -> None:
    from asyncengine.ipc.scheduler_output import SchedulerOutput

    empty = SchedulerOutput([], [], {}, 0, [])
    assert executor.execute_model(empty).req_ids == []


def test_no_worker_listens_on_a_network_interface(executor: MultiprocExecutor) -> None:
    # The rendezvous is a file in the executor's private directory, not a TCPStore (which
    # listened on every interface for the engine's lifetime); gloo's own sockets are loopback.
    for proc in executor._procs:
        assert proc.pid is not None
        listening = [
            c.laddr
            for c in psutil.Process(proc.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    executor.check_health()
