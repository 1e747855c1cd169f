"""Tensor parallelism behind AsyncLLM: a dead or failing worker reaches every stream as
EngineDeadError within a second, and no engine or worker process is left behind."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterable
from pathlib import Path

import anyio
import psutil
import pytest

from asyncengine import AsyncLLM, EngineDeadError, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.ipc.messages import UtilityCall
from asyncengine.testing import fault_injection
from asyncengine.testing.processes import assert_gone, child_pids
from asyncengine.testing.streams import kill_while_streaming

pytestmark = pytest.mark.timeout(120)

TP_KW = dict(
    device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=256, tensor_parallel_size=2
)
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


def _socket_dirs(pids: Iterable[int]) -> set[str]:
    """The socket directories that the processes `pids` made (named asyncengine-PID-...): a
    test looks only at its own, not at those of other runs on the machine."""
    prefixes = tuple(f"asyncengine-{pid}-" for pid in pids)
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(prefixes)}


def _worker_pids(engine: AsyncLLM) -> list[int]:
    client = engine._core_client
    assert isinstance(client, ProcCoreClient) and client.proc is not None
    core = psutil.Process(client.proc.pid)
    workers = [p.pid for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2, workers
    return workers


async def test_sigkill_of_a_worker_reaches_every_stream(tiny_llama: Path) -> None:
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, **TP_KW) as engine:
        victim = _worker_pids(engine)[1]
        errors, delay = await kill_while_streaming(
            engine, lambda: os.kill(victim, signal.SIGKILL), num_streams=3
        )
        assert len(errors) == 3
        assert delay < 1.0, f"streams learnt of the death after {delay:.2f} s"
        assert f"pid {victim}) died with exit code -9" in str(errors[0])
        with pytest.raises(EngineDeadError):
            await engine.generate("hello", LONG).__anext__()
    assert_gone(child_pids() - before)


async def test_an_exception_in_a_worker_reaches_the_client(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)  # inherited by the core and its workers
    before = child_pids()
    async with AsyncLLM.from_pretrained(tiny_llama, **TP_KW) as engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient)
        errors, delay = await kill_while_streaming(
            engine,
            lambda: client.call_utility_nowait(
                UtilityCall(10_000, "testing_collective_rpc", ["testing_fail_next_step", 1])
            ),
            num_streams=3,
        )
        assert len(errors) == 3 and delay < 1.0
        assert "injected failure in worker rank 1" in str(errors[0])
    assert_gone(child_pids() - before)


async def test_workers_die_with_the_engine_core(tiny_llama: Path) -> None:
    before = child_pids()
    dirs_before = _socket_dirs([os.getpid()])
    async with AsyncLLM.from_pretrained(tiny_llama, **TP_KW) as engine:
        workers = _worker_pids(engine)
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        assert client.proc.pid is not None
        ours = [os.getpid(), client.proc.pid, *workers]
        os.kill(client.proc.pid, signal.SIGKILL)
        # No orphans: each worker watches its parent and exits when it dies.
        assert_gone(set(workers), timeout=5.0)
        with anyio.fail_after(5), pytest.raises(EngineDeadError):
            async for _ in engine.generate("hello", LONG):
                pass
    assert_gone(child_pids() - before)
    # Neither the client's socket directory nor the killed core's executor's is left.
    assert not _socket_dirs(ours) - dirs_before, _socket_dirs(ours) - dirs_before


async def test_two_tp_engines_side_by_side(tiny_llama: Path) -> None:
    before = child_pids()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results: dict[int, list[int]] = {}

    async def run(i: int, engine: AsyncLLM) -> None:
        async for out in engine.generate("the same prompt", greedy):
            results[i] = out.outputs[0].token_ids

    # Each engine's process group rendezvous on a port its rank 0 got from the OS.
    async with (
        AsyncLLM.from_pretrained(tiny_llama, **TP_KW) as a,
        AsyncLLM.from_pretrained(tiny_llama, **TP_KW) as b,
    ):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0, a)
                tg.start_soon(run, 1, b)
        assert len(results[0]) == 16 and results[0] == results[1]
        assert not a.errored and not b.errored
    assert_gone(child_pids() - before)


_CTRL_C_PROGRAM = """
import asyncio
from asyncengine import AsyncLLM, SamplingParams

async def main():
    async with AsyncLLM.from_pretrained({model!r}, device="cpu", dtype="float32", max_model_len=256,
                                        num_kv_blocks=64, tensor_parallel_size=2) as engine:
        print("ready", flush=True)
        async for _ in engine.generate("hello", SamplingParams(max_tokens=240, ignore_eos=True)):
            await asyncio.sleep(0.05)

asyncio.run(main())
"""


def test_ctrl_c_of_a_tp_app_leaves_no_process_or_socket_dir(
    tiny_llama: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    script = tmp_path / "app.py"
    script.write_text(_CTRL_C_PROGRAM.format(model=str(tiny_llama)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches every process of the job
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        assert proc.stdout is not None
        proc.stdout.close()
    assert_gone(set(tree), timeout=10.0)
    assert not _socket_dirs(tree), _socket_dirs(tree)  # the app's processes are all new
