"""Every tensor-parallel worker of every data-parallel rank runs on a GPU of its own.

With the mp backend, rank r's worker t runs on visible GPU r * tp + t: each rank's core
process narrows CUDA_VISIBLE_DEVICES to its share, and inside it worker t is cuda:t. More
ranks x workers than visible GPUs is a ValueError naming the numbers before anything starts.
Ray gives each rank's actor its own GPUs (num_gpus).

The GPUs are simulated: the driver's count (/proc/driver/nvidia/gpus) and torch.cuda's
functions are monkeypatched, so this runs the same with or without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import asyncengine.config as config_module
import asyncengine.gpus as gpus_module
from asyncengine import AsyncLLM, EngineConfig
from asyncengine.child_process import ChildProcess
from asyncengine.client.cores.ray_core import RayCluster
from asyncengine.config import check_gpu_count
from asyncengine.executor.placement import claim_rank_gpus, rank_gpus, worker_device
from asyncengine.gpus import visible_gpus

pytestmark = pytest.mark.timeout(60)

CUDA_ENV = "CUDA_VISIBLE_DEVICES"


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A machine whose driver lists `gpus.installed` GPUs (8 unless a test sets it), with no
    CUDA_VISIBLE_DEVICES."""

    class Machine:
        installed = 8

    monkeypatch.setattr(gpus_module, "_nvidia_gpus", lambda: [""] * Machine.installed)
    monkeypatch.delenv(CUDA_ENV, raising=False)
    yield Machine


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """torch.cuda as a core process that sees `calls["count"]` GPUs would find it; the
    devices made current are recorded in `calls["set_device"]`."""
    import torch

    calls: dict[str, Any] = {"count": 1, "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls["count"])
    monkeypatch.setattr(torch.cuda, "set_device", calls["set_device"].append)
    yield calls


def cuda_config(model: Path, **kwargs: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(model, device="cuda", dtype="float32", **kwargs)


# --- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (3, 2)])
def test_each_worker_of_each_rank_runs_on_a_gpu_of_its_own(
    gpus: Any, cuda_calls: dict[str, Any], tiny_llama: Path, dp: int, tp: int
) -> None:
    config = cuda_config(tiny_llama, data_parallel_size=dp, tensor_parallel_size=tp)
    used: dict[tuple[int, int], int] = {}
    for rank in range(dp):
        env: dict[str, str] = {}
        claimed = claim_rank_gpus(config.for_rank(rank).parallel_config, "cuda", env)
        assert claimed == env[CUDA_ENV]
        own = env[CUDA_ENV].split(",")
        assert len(own) == tp  # the core sees its own GPUs and no others
        cuda_calls["count"] = len(own)
        for worker in range(tp):
            device = worker_device("cuda", worker)
            assert (device.type, device.index) == ("cuda", worker)
            assert cuda_calls["set_device"][-1] == device
            used[rank, worker] = int(own[device.index])  # the machine's GPU behind cuda:t
    assert used == {(r, t): r * tp + t for r in range(dp) for t in range(tp)}


def test_ranks_split_the_gpus_cuda_visible_devices_names_in_its_order(gpus: Any) -> None:
    parallel = config_module.ParallelConfig(
        data_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    env = {CUDA_ENV: "7,5,3,1,0"}
    assert claim_rank_gpus(parallel, "cuda", env) == "7,5"
    env = {CUDA_ENV: "7,5,3,1,0"}
    rank1 = dataclasses.replace(parallel, data_parallel_rank=1)
    assert claim_rank_gpus(rank1, "cuda", env) == "3,1"
    uuids = ["GPU-aaaa", "GPU-bbbb", "MIG-cccc", "MIG-dddd"]
    assert rank_gpus(rank1, uuids) == ["MIG-cccc", "MIG-dddd"]


def test_the_uniproc_worker_of_a_core_is_cuda_0_of_its_gpus(
    gpus: Any, cuda_calls: dict[str, Any], tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=1: the worker runs in the core process; the core's own GPU is its cuda:0."""
    import torch

    from asyncengine.executor import uniproc

    made: list[torch.device | None] = []

    class FakeWorker:
        def __init__(self, *args: Any, device: torch.device | None = None, **kw: Any) -> None:
            made.append(device)

        def load_model(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(uniproc, "Worker", FakeWorker)
    config = cuda_config(tiny_llama, data_parallel_size=3).for_rank(2)
    env: dict[str, str] = {}
    claim_rank_gpus(config.parallel_config, "cuda", env)
    assert env[CUDA_ENV] == "2"
    uniproc.UniProcExecutor(config).shutdown()
    assert made == [torch.device("cuda", 0)]
    assert cuda_calls["set_device"] == [torch.device("cuda", 0)]


def test_an_engine_core_process_claims_its_ranks_gpus_before_importing_the_model(
    gpus: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncengine.core import engine_core, engine_core_proc

    seen: list[str | None] = []
    monkeypatch.setattr(engine_core_proc, "skip_unused_packages", lambda mc: None)
    monkeypatch.setattr(
        engine_core, "import_model_code", lambda *a, **k: seen.append(os.environ.get(CUDA_ENV))
    )
    monkeypatch.setenv(CUDA_ENV, "4,5,6,7")
    config = cuda_config(tiny_llama, data_parallel_size=2, tensor_parallel_size=2)
    engine_core_proc._prepare_process(config.for_rank(1))
    assert seen == ["6,7"]


def test_cpu_and_ray_ranks_leave_cuda_visible_devices_alone(
    gpus: Any, cuda_calls: dict[str, Any]
) -> None:
    parallel = config_module.ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    env = {CUDA_ENV: "0,1"}
    assert claim_rank_gpus(parallel, "cpu", env) is None
    ray = config_module.ParallelConfig(
        data_parallel_size=2, data_parallel_rank=1, data_parallel_backend="ray"
    )
    assert claim_rank_gpus(ray, "cuda", env) is None  # Ray set it to the actor's GPUs
    assert env == {CUDA_ENV: "0,1"}
    assert worker_device("cpu", 0).type == "cpu"
    assert cuda_calls["set_device"] == []


# --- counting GPUs without torch ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ["0", "1", "2", "3"]),
        ("", []),
        ("-1", []),
        ("2,3", ["2", "3"]),
        (" 3 , 1", ["3", "1"]),
        ("1,7,2", ["1"]),  # CUDA stops at the first device that does not exist
        ("1,1,2", ["1"]),  # ... or repeats
        ("0,foo,1", ["0"]),
        ("GPU-1234,MIG-5678", ["GPU-1234", "MIG-5678"]),
    ],
)
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(
    gpus: Any, value: str | None, expected: list[str]
) -> None:
    gpus.installed = 4
    env = {} if value is None else {CUDA_ENV: value}
    assert visible_gpus(env) == expected


def test_gpu_uuids_are_checked_against_the_drivers(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = ["GPU-aaaa-1111", "GPU-bbbb-2222"]
    monkeypatch.setattr(gpus_module, "_nvidia_gpus", lambda: installed)
    assert visible_gpus({CUDA_ENV: "GPU-bbbb,GPU-aaaa-1111"}) == ["GPU-bbbb", "GPU-aaaa-1111"]
    assert visible_gpus({CUDA_ENV: "GPU-bbbb,GPU-cccc,GPU-aaaa"}) == ["GPU-bbbb"]
    assert visible_gpus({CUDA_ENV: "MIG-dddd"}) == ["MIG-dddd"]  # taken as given


def test_without_driver_information_the_count_is_unknown_and_not_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpus_module, "_nvidia_gpus", lambda: None)
    assert visible_gpus({}) is None
    assert visible_gpus({CUDA_ENV: "0,5"}) == ["0", "5"]  # no way to tell 5 is missing
    check_gpu_count(config_module.ParallelConfig(data_parallel_size=64), None)


def test_counting_gpus_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from asyncengine.gpus import visible_gpus; visible_gpus(); "
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr


# --- too many ranks x workers ---------------------------------------------------------------------


def test_more_ranks_than_gpus_is_an_error_naming_the_numbers(
    gpus: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus.installed = 1
    with pytest.raises(ValueError) as info:
        cuda_config(tiny_llama, data_parallel_size=2)
    assert str(info.value).startswith(
        "data_parallel_size=2 x tensor_parallel_size=1 needs 2 GPUs, but 1 is visible "
        "(no CUDA_VISIBLE_DEVICES)"
    )
    gpus.installed = 8
    monkeypatch.setenv(CUDA_ENV, "4,5,6")
    with pytest.raises(ValueError, match=r"=2 x tensor_parallel_size=2 needs 4 GPUs, but 3 are "
                       r"visible \(CUDA_VISIBLE_DEVICES='4,5,6'\)"):  # fmt: skip
        cuda_config(tiny_llama, data_parallel_size=2, tensor_parallel_size=2)
    cuda_config(tiny_llama, data_parallel_size=3)  # three fit
    # Ray ranks take their GPUs from the cluster, not from this machine.
    cuda_config(tiny_llama, data_parallel_size=4, data_parallel_backend="ray")


async def test_too_many_ranks_fail_before_any_process_starts(
    gpus: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus.installed = 1

    def start(self: ChildProcess) -> None:
        raise AssertionError(f"{self.name} was started")

    monkeypatch.setattr(ChildProcess, "start", start)
    with pytest.raises(ValueError, match="needs 2 GPUs, but 1 is visible"):
        async with AsyncLLM.from_pretrained(
            tiny_llama, device="cuda", dtype="float32", data_parallel_size=2
        ):
            pass


def test_a_core_that_sees_too_few_gpus_names_the_worker(cuda_calls: dict[str, Any]) -> None:
    """The last line of defence, where the client could not count (Ray, no driver info)."""
    cuda_calls["count"] = 1
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 needs GPU 1 .* sees 1"):
        worker_device("cuda", 1)
    assert cuda_calls["set_device"] == []


def test_a_rank_beyond_the_visible_gpus_is_refused_in_its_core(gpus: Any) -> None:
    rank1 = config_module.ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    with pytest.raises(ValueError, match=r"rank 1 needs GPUs 1\.\.1 .* but 1 is visible \(3\)"):
        claim_rank_gpus(rank1, "cuda", {CUDA_ENV: "3"})


# --- Ray ------------------------------------------------------------------------------------------


def test_ray_actors_ask_for_a_gpu_per_worker(
    gpus: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'asyncengine[ray]'")
    config = cuda_config(
        tiny_llama, data_parallel_size=2, tensor_parallel_size=2, data_parallel_backend="ray"
    )
    cluster = RayCluster(config)
    assert cluster.bundle == {"CPU": 2.0, "GPU": 2.0}
    options: list[dict[str, Any]] = []

    class Remote:
        def options(self, **kwargs: Any) -> Remote:
            options.append(kwargs)
            return self

        def remote(self) -> str:
            return "actor"

    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    assert cluster.make_actor(1, "engine core rank 1") == "actor"
    assert options[0]["num_gpus"] == 2.0
    cpu = RayCluster(
        EngineConfig.from_kwargs(
            tiny_llama, device="cpu", data_parallel_size=2, data_parallel_backend="ray"
        )
    )
    assert "GPU" not in cpu.bundle


@pytest.mark.timeout(180)
def test_ray_gives_each_rank_actor_its_own_gpus(gpus: Any, tiny_llama: Path) -> None:
    """A real local Ray cluster that declares 4 GPUs: each rank's actor (and so its core,
    which inherits its environment) sees its own 2 of them."""
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'asyncengine[ray]'")
    if ray.is_initialized():
        pytest.skip("a Ray connection of another test is open")
    config = cuda_config(
        tiny_llama, data_parallel_size=2, tensor_parallel_size=2, data_parallel_backend="ray"
    )
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, logging_level="WARNING")
    cluster = RayCluster(config)
    try:
        cluster.start(timeout=60)
        actors = [cluster.make_actor(rank, f"engine core rank {rank}") for rank in range(2)]
        seen = ray.get(
            [a.__ray_call__.remote(lambda self: os.environ.get(CUDA_ENV)) for a in actors],
            timeout=60,
        )
        for actor in actors:
            ray.kill(actor)
    finally:
        cluster.stop()
        ray.shutdown()
    own = [sorted(value.split(",")) for value in seen]
    assert all(len(gpus_of_rank) == 2 for gpus_of_rank in own)
    assert sorted(own[0] + own[1]) == ["0", "1", "2", "3"]
