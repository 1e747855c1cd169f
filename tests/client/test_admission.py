"""What an engine in a long-lived service admits: backpressure (`max_queued_requests`) and
drain. Real engine-core processes; after every test no KV block is leaked and no process is
left."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids, wait_until_idle

from asyncengine import AsyncLLM, EngineDrainingError, EngineOverloadedError, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.outputs import RequestOutput

pytestmark = pytest.mark.timeout(120)

LIMIT = 4
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncLLM]:
    before = child_pids()
    # One sequence at a time, so requests really wait in the core's queue.
    kw = {**ENGINE_KW, "max_num_seqs": 1, "max_queued_requests": LIMIT}
    async with AsyncLLM.from_pretrained(tiny_llama, **kw) as engine:
        yield engine
        if engine.is_running:
            stats = await wait_until_idle(engine)
            assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert_gone(child_pids() - before)


class _Started:
    """Counts requests as they are submitted; `wait()` returns once `n` are."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.event = anyio.Event()

    def add(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.event.set()

    async def wait(self) -> None:
        with anyio.fail_after(10):
            await self.event.wait()


async def _final(
    engine: AsyncLLM, prompt: str, params: SamplingParams, started: _Started | None = None
) -> RequestOutput:
    if started is not None:
        # generate() registers its request in this same step (it runs up to its first wait).
        started.add()
    outs = [out async for out in engine.generate(prompt, params)]
    return outs[-1]


async def test_the_overflow_is_refused_at_once_and_the_rest_complete(engine: AsyncLLM) -> None:
    finals: list[RequestOutput] = []
    refused: list[EngineOverloadedError] = []

    async def one(i: int) -> None:
        try:
            finals.append(await _final(engine, f"hello {i}", SHORT))
        except EngineOverloadedError as exc:
            refused.append(exc)

    # All 2 x LIMIT start in one batch of the event loop, before any output comes back.
    async with anyio.create_task_group() as tg:
        for i in range(2 * LIMIT):
            tg.start_soon(one, i)
    assert len(refused) == LIMIT and len(finals) == LIMIT
    assert "max_queued_requests=4" in str(refused[0])
    assert all(f.outputs[0].finish_reason == "length" for f in finals)
    # Once the queue has room again, requests are admitted.
    assert (await _final(engine, "again", SHORT)).finished


async def test_one_of_several_api_servers_admits_its_share(tiny_llama: Path) -> None:
    """`serve --api-server-count 2`: each API server's AsyncLLM admits half the server's
    bound, so that the two together hold at most max_queued_requests."""
    before = child_pids()
    kw = {**ENGINE_KW, "max_num_seqs": 1, "max_queued_requests": LIMIT}
    config = EngineConfig.from_kwargs(tiny_llama, **kw).for_api_server(1, 2)
    finals: list[RequestOutput] = []
    refused: list[EngineOverloadedError] = []

    async def one(i: int) -> None:
        try:
            finals.append(await _final(engine, f"hello {i}", SHORT))
        except EngineOverloadedError as exc:
            refused.append(exc)

    async with AsyncLLM(config) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(LIMIT):
                tg.start_soon(one, i)
        assert len(finals) == len(refused) == LIMIT // 2
        assert "max_queued_requests=4 over 2 API servers: 2 in this one" in str(refused[0])
    assert_gone(child_pids() - before)


async def test_drain_lets_streams_in_flight_finish_and_refuses_new_ones(
    engine: AsyncLLM, tiny_llama: Path
) -> None:
    finals: list[RequestOutput] = []
    started = _Started(LIMIT)

    async def one(i: int) -> None:
        finals.append(await _final(engine, f"hello {i}", SHORT, started))

    async with anyio.create_task_group() as tg:
        for i in range(LIMIT):
            tg.start_soon(one, i)
        await started.wait()
        await engine.drain()
        assert engine.is_draining
        with pytest.raises(EngineDrainingError):
            await _final(engine, "late", SHORT)
    assert len(finals) == LIMIT
    assert all(f.outputs[0].finish_reason == "length" for f in finals)
    await engine.check_health()  # utility calls still work while draining
    stats = await engine.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_drain_aborts_what_is_left_at_its_timeout(engine: AsyncLLM) -> None:
    finals: list[RequestOutput] = []
    started = _Started(LIMIT)

    async def one(i: int) -> None:
        finals.append(await _final(engine, f"hello {i}", LONG, started))

    # One sequence at a time: 4 x 240 steps take well over the drain's 0.1 s.
    async with anyio.create_task_group() as tg:
        for i in range(LIMIT):
            tg.start_soon(one, i)
        await started.wait()
        with anyio.fail_after(10):
            await engine.drain(timeout=0.1)
    reasons = [f.outputs[0].finish_reason for f in finals]
    assert len(finals) == LIMIT and reasons.count("abort") >= 2, reasons
    assert set(reasons) <= {"abort", "length"}
    assert all(
        len(f.outputs[0].token_ids) < LONG.max_tokens
        for f in finals
        if f.outputs[0].finish_reason == "abort"
    )


async def test_drain_with_many_streams_in_flight(tiny_llama: Path) -> None:
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        finals: list[RequestOutput] = []
        started = _Started(32)

        async def one(i: int) -> None:
            finals.append(await _final(engine, f"stream {i}", SHORT, started))

        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(one, i)
            await started.wait()
            with anyio.fail_after(60):
                await engine.drain(timeout=60)
        assert len(finals) == 32
        assert all(f.outputs[0].finish_reason == "length" for f in finals)
        stats = await engine.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert_gone(child_pids() - before)
