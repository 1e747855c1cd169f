"""A hang is a death: a step past `step_timeout` ends the engine loudly, and a core process
that stops answering (SIGSTOP) fails health checks within seconds and is killed once it has
been silent past `step_timeout`. Nothing waits forever; no process is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids

from asyncengine import AsyncLLM, EngineDeadError, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.ipc.messages import UtilityCall
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


async def _stream_until_dead(engine: AsyncLLM) -> EngineDeadError:
    with pytest.raises(EngineDeadError) as info:
        async for _ in engine.generate("hello", LONG):
            await anyio.sleep(0.01)
    return info.value


async def test_a_step_past_step_timeout_kills_the_engine(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, step_timeout=1.0, **ENGINE_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        client.call_utility_nowait(UtilityCall(10_000, "testing_hang_next_step", [60.0]))
        start = time.monotonic()
        with anyio.fail_after(15):
            error = await _stream_until_dead(engine)
        assert time.monotonic() - start < 1.0 + 5.0
        assert "step_timeout=1" in str(error)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        client.proc.join(5)
        assert client.proc.exitcode == 1
    assert_gone(child_pids() - before)


async def test_a_stopped_core_fails_health_at_once_then_is_killed(tiny_llama: Path) -> None:
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, step_timeout=6.0, **ENGINE_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        pid = client.proc.pid
        assert pid is not None
        errors: list[EngineDeadError] = []
        first = anyio.Event()

        async def stream() -> None:
            with pytest.raises(EngineDeadError) as info:
                async for _ in engine.generate("hello", LONG):
                    first.set()
            errors.append(info.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await first.wait()
            os.kill(pid, signal.SIGSTOP)  # mid-stream: 240 tokens take longer than this
            stopped = time.monotonic()
            await anyio.sleep(3.5)  # the heartbeat is missed for longer than 3 s
            with anyio.fail_after(1), pytest.raises(TimeoutError, match="sent nothing"):
                await engine.check_health(timeout=30)
        # The stream ended once the core had been silent past step_timeout, and it was killed.
        assert time.monotonic() - stopped < 6.0 + 4.0
        assert "step_timeout=6" in str(errors[0])
        client.proc.join(5)
        assert client.proc.exitcode == -signal.SIGKILL
    assert_gone(child_pids() - before)


async def test_a_hung_step_in_the_thread_core_ends_every_stream(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    kw = {**ENGINE_KW, "step_timeout": 1.0}
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **kw) as engine:
        await engine._call_utility("testing_hang_next_step", 3.0)
        with anyio.fail_after(10):
            error = await _stream_until_dead(engine)
        assert "step_timeout=1" in str(error)
