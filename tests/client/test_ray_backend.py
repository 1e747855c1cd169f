"""data_parallel_backend="ray": engine cores as Ray actors on a real two-node Ray cluster
(`ray.cluster_utils.Cluster`, every node on 127.0.0.1, no dashboard), one rank per node.

Equal outputs, both ranks serve, a killed actor fails only its rank's streams, and after
`aclose()` no actor or placement group of the engine is left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from async_helpers import ENGINE_KW

from asyncengine import AsyncLLM, EngineDeadError, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.client.cores.ray_core import RayCore

# tests/conftest.py sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before anything imports ray:
# with it every node of the test cluster binds 127.0.0.1, not the machine's interface.
ray = pytest.importorskip(
    "ray", reason="ray cannot be installed here: pip install 'asyncengine[ray]'"
)

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
RAY_KW = dict(ENGINE_KW, num_kv_blocks=256, data_parallel_size=2, data_parallel_backend="ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two nodes of one CPU each: a rank's bundle ({"CPU": 1}) fits one per node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i + j) % 200 + 3 for j in range(4 + i % 7)] for i in range(n)]


async def _run_all(engine: AsyncLLM, prompts: list[list[int]]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        async for out in engine.generate(prompts[i], GREEDY):
            results[i] = list(out.outputs[0].token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def _live_engine_actors() -> list[dict[str, Any]]:
    from ray._private import state

    return [
        a
        for a in state.actors().values()
        if a["State"] != "DEAD" and a["ActorClassName"].endswith("EngineCoreActor")
    ]


def _live_placement_groups() -> list[Any]:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
            return await _run_all(engine, _prompts(16))

    return anyio.run(run)


async def test_ray_ranks_on_two_nodes_equal_outputs_and_leave_nothing(
    ray_cluster: Any, tiny_llama: Path, reference: list[list[int]]
) -> None:
    async with AsyncLLM.from_pretrained(
        tiny_llama, data_parallel_routing="load", **RAY_KW
    ) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient)
        assert all(isinstance(c, RayCore) and c.input_address.startswith("tcp://127.0.0.1:")
                   for c in client.cores)  # fmt: skip
        nodes = {a["Address"]["NodeID"] for a in _live_engine_actors()}
        assert len(nodes) == 2, "one rank per node"
        assert await _run_all(engine, _prompts(16)) == reference
        stats = await engine.statistics()
        assert [r.num_prefill_tokens > 0 for r in stats.ranks] == [True, True]
        assert len(_live_placement_groups()) == 1
    assert _live_engine_actors() == []
    assert _live_placement_groups() == []


async def test_a_killed_ray_actor_fails_only_its_rank(
    ray_cluster: Any, tiny_llama: Path, reference: list[list[int]]
) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, **RAY_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient)
        victim = client.cores[1]
        assert isinstance(victim, RayCore)
        errors: list[tuple[EngineDeadError, float]] = []
        started: set[int] = set()
        streaming = anyio.Event()

        async def consume(i: int) -> None:
            try:
                async for _ in engine.generate(f"hello {i}", LONG, data_parallel_rank=1):
                    started.add(i)
                    if len(started) == 2:
                        streaming.set()
                    await anyio.sleep(0.05)
            except EngineDeadError as exc:
                errors.append((exc, time.monotonic()))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(consume, i)
                await streaming.wait()
                killed_at = time.monotonic()
                ray.kill(victim.actor)
        assert len(errors) == 2 and all("rank 1" in str(e) for e, _ in errors)
        assert max(t for _, t in errors) - killed_at < 1.0
        assert await _run_all(engine, _prompts(4)) == reference[:4]
        health = await engine.check_health()
        assert health.degraded and not health.ranks[1].healthy
    assert _live_engine_actors() == []
    assert _live_placement_groups() == []


async def test_a_ray_rank_that_fails_to_start_leaves_nothing(
    ray_cluster: Any, tiny_llama: Path
) -> None:
    from asyncengine import EngineStartupError

    # No machine has room for this KV cache: every rank fails while allocating it.
    kw = dict(RAY_KW, num_kv_blocks=2**40)
    with pytest.raises(EngineStartupError, match=r"engine core rank \d failed to start"):
        async with AsyncLLM.from_pretrained(tiny_llama, startup_timeout=120, **kw):
            pass
    assert _live_engine_actors() == []
    assert _live_placement_groups() == []
