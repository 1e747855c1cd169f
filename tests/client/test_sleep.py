"""sleep / wake_up: the KV cache's memory (level 1), and the weights' (level 2), go back to
the system while the engine is idle; requests queue meanwhile; after waking, outputs are as
before."""

from __future__ import annotations

from pathlib import Path

import anyio
import psutil
import pytest
from async_helpers import ENGINE_KW

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.outputs import RequestOutput

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = {k: v for k, v in ENGINE_KW.items() if k != "num_kv_blocks"}


def _tree_memory(pid: int) -> tuple[int, int]:
    """Resident and virtual bytes of `pid` and its descendants."""
    root = psutil.Process(pid)
    infos = [p.memory_info() for p in [root, *root.children(recursive=True)]]
    return sum(i.rss for i in infos), sum(i.vms for i in infos)


async def _final(engine: AsyncLLM, prompt: str) -> RequestOutput:
    return [out async for out in engine.generate(prompt, GREEDY)][-1]


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_releases_memory_and_wake_up_restores_the_engine(
    tiny_llama: Path, level: int
) -> None:
    kw = {**KW, "kv_cache_memory_bytes": 256 * 2**20}
    async with AsyncLLM.from_pretrained(tiny_llama, **kw) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        pid = client.proc.pid
        assert pid is not None
        before = await _final(engine, "hello world")
        awake_rss, awake_vms = _tree_memory(pid)
        await engine.sleep(level=level)
        assert engine.is_sleeping
        # The CPU cache's pages are resident only where blocks were written (a few here), so
        # its release shows in the address space: the whole 256 MiB mapping is gone.
        asleep_rss, asleep_vms = _tree_memory(pid)
        assert asleep_vms < awake_vms - 200 * 2**20
        assert asleep_rss <= awake_rss
        late: list[RequestOutput] = []

        async def queued() -> None:
            late.append(await _final(engine, "hello world"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(queued)
            await anyio.sleep(0.3)
            assert not late  # it waits for the engine to wake
            await engine.wake_up()
        assert not engine.is_sleeping and not engine.is_paused
        assert late[0].outputs[0].token_ids == before.outputs[0].token_ids
        again = await _final(engine, "hello world")
        assert again.outputs[0].token_ids == before.outputs[0].token_ids
        stats = await engine.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_a_bad_level_is_refused_and_resume_needs_wake_up(tiny_llama: Path) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        with pytest.raises(ValueError, match="level=3 is invalid"):
            await engine.sleep(level=3)
        await engine.sleep()
        with pytest.raises(RuntimeError, match="wake_up"):
            await engine.resume_generation()
        await engine.wake_up()
        assert (await _final(engine, "hello")).finished
