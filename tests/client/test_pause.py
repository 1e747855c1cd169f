"""pause_generation / resume_generation in each mode: what happens to the requests in flight
(aborted, finished first, or kept in place), and that new requests queue until resumed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.outputs import RequestOutput
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AsyncLLM]:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        await engine._call_utility("testing_delay_steps", 0.01)  # 100 tokens take ~1 s
        yield engine
        stats = await wait_until_idle(engine)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


class _Stream:
    """A request streamed in the background: its outputs, and an event at the first."""

    def __init__(self, engine: AsyncLLM, prompt: str, params: SamplingParams) -> None:
        self.engine, self.prompt, self.params = engine, prompt, params
        self.outputs: list[RequestOutput] = []
        self.first = anyio.Event()

    async def run(self) -> None:
        async for out in self.engine.generate(self.prompt, self.params):
            self.outputs.append(out)
            self.first.set()

    @property
    def final(self) -> RequestOutput:
        assert self.outputs and self.outputs[-1].finished
        return self.outputs[-1]


async def test_abort_mode_ends_what_runs_and_queues_what_comes(engine: AsyncLLM) -> None:
    running = [_Stream(engine, f"hello {i}", LONG) for i in range(3)]
    late = _Stream(engine, "late", SHORT)
    async with anyio.create_task_group() as tg:
        for s in running:
            tg.start_soon(s.run)
        for s in running:
            await s.first.wait()
        await engine.pause_generation(mode="abort")
        assert engine.is_paused
        tg.start_soon(late.run)
        await anyio.sleep(0.3)
        assert not late.outputs  # queued while paused
        await engine.resume_generation()
        assert not engine.is_paused
    assert [s.final.outputs[0].finish_reason for s in running] == ["abort"] * 3
    assert late.final.outputs[0].finish_reason == "length"


async def test_wait_mode_lets_what_runs_finish_first(engine: AsyncLLM) -> None:
    running = [_Stream(engine, f"hello {i}", SHORT) for i in range(3)]
    late = _Stream(engine, "late", SHORT)
    async with anyio.create_task_group() as tg:
        for s in running:
            tg.start_soon(s.run)
        for s in running:
            await s.first.wait()
        await engine.pause_generation(mode="wait")
        assert all(s.outputs[-1].finished for s in running)  # done when pause returned
        tg.start_soon(late.run)
        await anyio.sleep(0.3)
        assert not late.outputs
        await engine.resume_generation()
    assert [s.final.outputs[0].finish_reason for s in running] == ["length"] * 3
    assert late.final.outputs[0].finish_reason == "length"


async def test_keep_mode_suspends_requests_in_place(engine: AsyncLLM) -> None:
    kept = _Stream(engine, "hello", LONG)
    async with anyio.create_task_group() as tg:
        tg.start_soon(kept.run)
        await kept.first.wait()
        await engine.pause_generation(mode="keep")
        await anyio.sleep(0.1)  # outputs of the step in flight when it paused
        count = len(kept.outputs[-1].outputs[0].token_ids)
        await anyio.sleep(0.3)
        assert len(kept.outputs[-1].outputs[0].token_ids) == count < LONG.max_tokens
        stats = await engine.statistics()
        assert stats.num_running_reqs == 1 and stats.num_free_kv_blocks < stats.num_kv_blocks
        await engine.resume_generation()
    final = kept.final.outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == LONG.max_tokens


async def test_a_bad_mode_is_refused(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="mode='sleep' is invalid"):
        await engine.pause_generation(mode="sleep")
    assert not engine.is_paused
