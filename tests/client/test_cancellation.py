"""Cancellation reaches the core in every state: a request cancelled while it waits never
runs its prefill, and one cancelled in the middle of a chunked prefill stops after the
current step. Judged by the engine's own counter of prefill tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(120)

PROMPT_A = list(range(10, 30))  # 20 tokens
PROMPT_B = list(range(100, 300))  # 200 tokens


@pytest.fixture
async def engine(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AsyncLLM]:
    monkeypatch.setenv(*fault_injection.ENV)
    # One sequence at a time, and prefills in chunks of 16 tokens.
    kw = {**ENGINE_KW, "max_num_seqs": 1, "max_num_batched_tokens": 16}
    async with AsyncLLM.from_pretrained(tiny_llama, **kw) as engine:
        await engine._call_utility("testing_delay_steps", 0.02)  # steps a test can act between
        yield engine
        stats = await wait_until_idle(engine)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_a_request_cancelled_while_waiting_never_prefills(engine: AsyncLLM) -> None:
    running = anyio.Event()

    async def first() -> None:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        async for _ in engine.generate(PROMPT_A, params):
            running.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await running.wait()  # A holds the only running slot for ~0.6 s
        with anyio.move_on_after(0.1) as scope:
            async for _ in engine.generate(PROMPT_B, SamplingParams(max_tokens=4)):
                pass
        assert scope.cancelled_caught
    stats = await wait_until_idle(engine)
    assert stats.num_prefill_tokens == len(PROMPT_A)  # none of B's 200


async def test_a_request_cancelled_mid_prefill_stops_after_the_current_step(
    engine: AsyncLLM,
) -> None:
    # 200 prompt tokens in chunks of 16: 13 steps of 20 ms. Cancelled once a chunk is done.
    async with anyio.create_task_group() as tg:

        async def request() -> None:
            async for _ in engine.generate(PROMPT_B, SamplingParams(max_tokens=4)):
                pass

        tg.start_soon(request)
        with anyio.fail_after(10):
            # Polls the core's own counter: there is no event to wait on.
            while (await engine.statistics()).num_prefill_tokens < 16:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    stats = await wait_until_idle(engine)
    done = stats.num_prefill_tokens
    assert 16 <= done < len(PROMPT_B)
    await anyio.sleep(0.2)  # ten steps' time: nothing more is computed for it
    assert (await engine.statistics()).num_prefill_tokens == done
