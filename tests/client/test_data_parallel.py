"""Data parallel: several engine-core processes behind one AsyncLLM.

Real processes and sockets: outputs equal DP=1's token for token, the router spreads work
(or keeps a shared prefix on one rank), a pinned rank is honoured, a dead rank fails only its
own streams, a rank that fails to start stops the others, and nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psutil
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids

from asyncengine import AsyncLLM, EngineDeadError, EngineStartupError, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import EngineStats
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
DP_KW = dict(ENGINE_KW, data_parallel_size=2)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 3 for j in range(5 + i % 11)] for i in range(n)]


async def _run_all(
    engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, **kw: object
) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        async for out in engine.generate(prompts[i], params, **kw):  # type: ignore[arg-type]
            results[i] = list(out.outputs[0].token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def _rank_stats(stats: EngineStats) -> list[EngineStats]:
    assert [r.data_parallel_rank for r in stats.ranks] == list(range(len(stats.ranks)))
    return list(stats.ranks)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    """DP=1's greedy tokens for the 64 prompts (the in-process core: same numbers)."""

    async def run() -> list[list[int]]:
        async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
            return await _run_all(engine, _prompts(64), GREEDY)

    return anyio.run(run)


async def test_dp2_equals_dp1_spreads_work_and_honours_a_pinned_rank(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    async with AsyncLLM.from_pretrained(
        tiny_llama, data_parallel_routing="load", **DP_KW
    ) as engine:
        assert engine.config.cache_config.num_kv_blocks == 2 * ENGINE_KW["num_kv_blocks"]
        assert await _run_all(engine, _prompts(64), GREEDY) == reference
        ranks = _rank_stats(await engine.statistics())
        assert all(r.num_prefill_tokens > 0 for r in ranks), ranks
        total = await engine.get_stats()
        assert total.num_prefill_tokens == sum(r.num_prefill_tokens for r in ranks)

        before = [r.num_prefill_tokens for r in ranks]
        pinned = await _run_all(engine, _prompts(6), GREEDY, data_parallel_rank=1)
        assert pinned == reference[:6]
        after = [r.num_prefill_tokens for r in _rank_stats(await engine.statistics())]
        assert after[0] == before[0] and after[1] > before[1]

        with pytest.raises(ValueError, match=r"data_parallel_rank=2 is invalid.*\[0, 2\)"):
            await engine.generate("hi", GREEDY, data_parallel_rank=2).__anext__()
        health = await engine.check_health()
        assert health.status == "ok" and [r.rank for r in health.ranks] == [0, 1]


@pytest.mark.parametrize("routing", ["prefix", "load"])
async def test_a_shared_prefix_stays_on_one_rank_under_prefix_routing(
    tiny_llama: Path, routing: str
) -> None:
    shared = [(5 * j) % 190 + 4 for j in range(48)]  # three full 16-token blocks
    prompts = [[*shared, 100 + i, 7, 9] for i in range(16)]
    async with AsyncLLM.from_pretrained(
        tiny_llama, data_parallel_routing=routing, **DP_KW
    ) as engine:
        await _run_all(engine, prompts, GREEDY)
        ranks = _rank_stats(await engine.statistics())
    served = [r.num_prefill_tokens > 0 for r in ranks]
    if routing == "prefix":
        assert served.count(True) == 1, ranks
        assert max(r.prefix_cache_hits for r in ranks) > 0
    else:
        assert served == [True, True], ranks


async def test_a_killed_rank_fails_only_its_own_streams(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, **DP_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient)
        victim = client.cores[1].pid
        assert victim is not None
        errors: list[tuple[int, EngineDeadError, float]] = []
        finished: dict[int, list[int]] = {}
        streaming = anyio.Event()
        started: set[int] = set()
        killed_at = 0.0

        async def consume(i: int, rank: int) -> None:
            try:
                tokens: list[int] = []
                async for out in engine.generate(
                    _prompts(8)[i], LONG if rank == 1 else GREEDY, data_parallel_rank=rank
                ):
                    tokens = list(out.outputs[0].token_ids)
                    started.add(i)
                    if len(started) == 8:
                        streaming.set()
                    if rank == 0:
                        await anyio.sleep(0.05)  # still running when rank 1 dies
                finished[i] = tokens
            except EngineDeadError as exc:
                errors.append((i, exc, time.monotonic()))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(consume, i, i % 2)
                await streaming.wait()
                killed_at = time.monotonic()
                os.kill(victim, signal.SIGKILL)

        assert sorted(i for i, _, _ in errors) == [1, 3, 5, 7]
        assert max(t for _, _, t in errors) - killed_at < 1.0
        assert all("rank 1" in str(e) and "SIGKILL" in str(e) for _, e, _ in errors)
        assert finished == {i: reference[i] for i in (0, 2, 4, 6)}

        # The survivor serves new requests; the dead rank is reported, not routed to.
        assert await _run_all(engine, _prompts(6), GREEDY) == reference[:6]
        health = await engine.check_health()
        assert health.degraded and not health.ranks[1].healthy and health.ranks[0].healthy
        assert "SIGKILL" in (health.ranks[1].error or "")
        with pytest.raises(EngineDeadError, match="data_parallel_rank=1 is dead"):
            await engine.generate("hi", GREEDY, data_parallel_rank=1).__anext__()
        stats = await engine.statistics()
        assert [r.data_parallel_rank for r in stats.ranks] == [0]
        assert not engine.errored
    assert_gone(child_pids() - before)


async def test_fail_fast_makes_one_dead_rank_kill_the_engine(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(
        tiny_llama, data_parallel_fail_fast=True, **DP_KW
    ) as engine:
        await engine._call_utility("testing_delay_steps", 0.02)  # every rank: ~5 s a stream
        client = engine._core_client
        assert isinstance(client, ProcCoreClient)
        victim = client.cores[0].pid
        assert victim is not None
        errors: list[EngineDeadError] = []
        started: set[int] = set()
        streaming = anyio.Event()

        async def consume(i: int) -> None:
            try:
                async for _ in engine.generate(_prompts(4)[i], LONG, data_parallel_rank=i % 2):
                    started.add(i)
                    if len(started) == 4:
                        streaming.set()
            except EngineDeadError as exc:
                errors.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(consume, i)
                await streaming.wait()
                os.kill(victim, signal.SIGKILL)
        assert len(errors) == 4
        assert engine.errored and "data_parallel_fail_fast" in str(engine.dead_error)
        with pytest.raises(EngineDeadError):
            await engine.check_health()


async def test_a_rank_that_fails_to_start_stops_the_others(tiny_llama: Path) -> None:
    before = child_pids()
    client = ProcCoreClient(EngineConfig.from_kwargs(tiny_llama, **DP_KW), startup_timeout=60)
    await client.launch()
    pid = client.cores[1].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineStartupError, match=r"engine core rank 1 .*SIGKILL"):
        await client.start()
    assert_gone(child_pids() - before)
    assert not client.socket_dir.exists()


_PARENT = textwrap.dedent(
    """
    import sys, anyio
    from asyncengine import AsyncLLM

    async def main():
        async with AsyncLLM.from_pretrained(sys.argv[1], **{kw}) as engine:
            print("ready", flush=True)
            await anyio.sleep_forever()

    anyio.run(main)
    """
)


def test_parent_sigkill_with_dp2_and_tp2_leaves_no_process(
    tiny_llama: Path, tmp_path: Path
) -> None:
    script = tmp_path / "parent.py"
    kw = dict(DP_KW, tensor_parallel_size=2, num_kv_blocks=128)
    script.write_text(_PARENT.replace("{kw}", repr(kw)))
    with subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama)], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            assert parent.stdout.readline().strip() == "ready"
            tree = {p.pid for p in psutil.Process(parent.pid).children(recursive=True)}
            assert len(tree) >= 6, tree  # two cores, two workers each
            parent.send_signal(signal.SIGKILL)
            parent.wait(10)
        finally:
            parent.kill()
    assert_gone(tree, timeout=15.0)


def test_the_offline_llm_refuses_data_parallel(tiny_llama: Path) -> None:
    from asyncengine import LLM

    with pytest.raises(ValueError, match="data_parallel_size=2: the offline LLM"):
        LLM(tiny_llama, device="cpu", data_parallel_size=2)


async def test_data_parallel_needs_a_process_core(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="needs core='process'"):
        AsyncLLM.from_pretrained(tiny_llama, device="cpu", core="thread", data_parallel_size=2)


async def test_abort_reaches_the_rank_that_holds_the_request(tiny_llama: Path) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, **DP_KW) as engine:
        for rank in (1, 0):
            outputs = engine.generate("hello", LONG, data_parallel_rank=rank)
            await outputs.__anext__()
            running = [r.num_running_reqs for r in _rank_stats(await engine.statistics())]
            assert running[rank] == 1 and running[1 - rank] == 0
            await outputs.aclose()  # leaving the stream aborts the request on its rank
            with anyio.fail_after(5):
                while True:
                    stats = _rank_stats(await engine.statistics())
                    if stats[rank].num_running_reqs == 0:
                        break
                    await anyio.sleep(0.02)
            assert stats[rank].num_free_kv_blocks == stats[rank].num_kv_blocks
