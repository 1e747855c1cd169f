"""Bad input from a careless or hostile caller: refused with a clear error naming the field,
nothing left behind in the client's tables, and the engine goes on (issue 22's probe run)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.ipc.messages import EngineCoreRequest
from asyncengine.sampling_params import MAX_STOP_STRINGS
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)

BIG = 2**64 + 1


@pytest.fixture(scope="module")
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_pretrained(tiny_llama, max_num_seqs=8, **ENGINE_KW) as engine:
        yield engine


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n": 9}, r"n=9 is invalid: at most max_num_seqs=8"),
        ({"top_k": BIG}, r"SamplingParams\.top_k="),
        ({"stop_token_ids": [BIG]}, r"SamplingParams\.stop_token_ids="),
        ({"min_tokens": BIG}, r"SamplingParams\.min_tokens="),
        ({"max_tokens": BIG}, r"SamplingParams\.max_tokens="),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, r"at most 64 strings"),
        ({"stop": ["y" * 9000]}, r"8192 characters in all"),
    ],
)
async def test_out_of_range_values_are_refused_and_nothing_is_left(
    engine: AsyncLLM, fields: dict[str, Any], match: str
) -> None:
    op = engine._output_processor
    assert op is not None
    for _ in range(150):  # ~1,000 refused requests in all
        with pytest.raises(ValueError, match=match):
            params = SamplingParams(max_tokens=4)
            for name, value in fields.items():
                setattr(params, name, value)  # changed after construction, as a careless caller
            async for _ in engine.generate("hello", params):
                pass
    assert not op.requests and not engine._state.streams and op.num_queued == 0
    outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=4))]
    assert outs[-1].finished


async def test_a_priority_past_64_bits_is_refused(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match=r"priority=\d+ is invalid: must fit in 64 bits"):
        async for _ in engine.generate("hello", SamplingParams(max_tokens=2), priority=BIG):
            pass
    assert not engine._state.streams


async def test_statistics_times_out_like_check_health(engine: AsyncLLM) -> None:
    stats = await engine.statistics(timeout=5)
    assert stats.num_kv_blocks > 0
    stats = await wait_until_idle(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_the_core_refuses_token_ids_outside_the_vocabulary() -> None:
    from asyncengine.config import SchedulerConfig

    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, policy="fcfs"
    )
    sched = Scheduler(config, KVCacheManager(16, 4, True), (0,), vocab_size=100)
    for ids in ([5, 100], [-1, 3], []):
        with pytest.raises(ValueError, match=r"prompt"):
            sched.add_request(EngineCoreRequest("bad", ids, SamplingParams(), 0.0))
    assert not sched.has_requests()
    sched.add_request(EngineCoreRequest("good", [5, 99], SamplingParams(max_tokens=1), 0.0))
    assert sched.has_requests()


async def test_an_abort_the_client_did_not_send_still_ends_the_stream(engine: AsyncLLM) -> None:
    client = engine._core_client
    assert client is not None
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = []
    with anyio.fail_after(10):
        async for out in engine.generate("hello", long, request_id="victim"):
            outs.append(out)
            if len(outs) == 2:
                client.abort_requests_nowait(["victim"])  # as a foreign frame would
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
