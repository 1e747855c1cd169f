"""Engine death is loud and fast: every open stream raises EngineDeadError, new calls raise at
once, `async with` still exits cleanly, and no process is left behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import psutil
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids

from asyncengine import AsyncLLM, EngineDeadError, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.ipc.messages import UtilityCall
from asyncengine.testing import fault_injection
from asyncengine.testing.streams import kill_while_streaming

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


async def _assert_dead_everywhere(engine: AsyncLLM) -> None:
    assert engine.errored and isinstance(engine.dead_error, EngineDeadError)
    with pytest.raises(EngineDeadError):
        await engine.generate("hello", LONG).__anext__()
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await engine.get_stats()


async def test_sigkill_of_the_core_reaches_every_stream(tiny_llama: Path) -> None:
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        pid = client.proc.pid
        assert pid is not None

        errors, delay = await kill_while_streaming(engine, lambda: os.kill(pid, signal.SIGKILL))
        assert len(errors) == 4
        assert delay < 1.0, f"streams learnt of the death after {delay:.2f} s"
        assert "SIGKILL" in str(errors[0])
        await _assert_dead_everywhere(engine)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_gone(child_pids() - before)


async def test_injected_model_runner_failure_sends_engine_core_dead(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None

        def kill() -> None:
            # Fire and forget: the next execute_model raises, as a crashing runner would.
            client.call_utility_nowait(UtilityCall(10_000, "testing_fail_next_step"))

        errors, delay = await kill_while_streaming(engine, kill)
        assert len(errors) == 4 and delay < 1.0
        # The core's own report (ENGINE_CORE_DEAD) names the root cause.
        assert "injected model runner failure" in str(errors[0])
        await _assert_dead_everywhere(engine)
        client.proc.join(5)
        assert client.proc.exitcode not in (None, 0)


async def test_executor_failure_callback_kills_the_engine(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        with anyio.fail_after(10):
            await engine._call_utility("testing_notify_executor_failure")
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("hello", LONG):
                    pass
        assert "executor reported a failure" in str(engine.dead_error)
        await _assert_dead_everywhere(engine)


async def test_thread_core_failure_reaches_every_stream(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        client = engine._core_client
        assert client is not None
        errors, delay = await kill_while_streaming(
            engine,
            lambda: client.call_utility_nowait(UtilityCall(10_000, "testing_fail_next_step")),
        )
        assert len(errors) == 4 and delay < 1.0
        assert "injected model runner failure" in str(errors[0])
        await _assert_dead_everywhere(engine)


async def test_test_hooks_are_refused_without_the_variable(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(fault_injection.TEST_HOOKS_ENV, raising=False)
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        with pytest.raises(RuntimeError, match="unknown utility method"):
            await engine._call_utility("testing_fail_next_step")
        outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=3))]
        assert outs[-1].finished and not engine.errored


async def test_sigterm_of_the_core_is_a_clean_exit_and_a_dead_engine(tiny_llama: Path) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        pid = client.proc.pid
        assert pid is not None
        errors, delay = await kill_while_streaming(
            engine, lambda: os.kill(pid, signal.SIGTERM), num_streams=2
        )
        assert len(errors) == 2 and delay < 1.0
        client.proc.join(5)
        assert client.proc.exitcode == 0  # SIGTERM: a clean shutdown, not a crash
