"""Nothing is left behind, on any backend or place: aclose() joins every thread and process,
the core exits when its parent dies, the client side never imports torch, uvloop works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import psutil
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids

from asyncengine import LLM, AsyncLLM, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def test_aclose_leaves_no_child_process(tiny_llama: Path) -> None:
    before = child_pids()
    engine = AsyncLLM.from_pretrained(tiny_llama, core="process", **ENGINE_KW)
    async with engine:
        client = engine._core_client
        assert isinstance(client, ProcCoreClient) and client.proc is not None
        core_pid = client.proc.pid
        assert core_pid in child_pids()
        socket_dir = client.socket_dir
        assert socket_dir.is_dir()
        # A stream still open at exit is aborted; nothing waits for it.
        stream = engine.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await engine.aclose()
    assert child_pids() - before == set()
    assert not psutil.pid_exists(core_pid)
    assert not socket_dir.exists()
    await stream.aclose()


async def test_thread_core_matches_offline_and_joins_its_thread(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, **ENGINE_KW)
    expected = llm.generate(["hello world"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    threads_before = set(threading.enumerate())
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        outs = [o async for o in engine.generate("hello world", GREEDY)]
        await engine.check_health()
        assert any(t.name == "AsyncEngineCore" for t in threading.enumerate())
    assert outs[-1].outputs[0].token_ids == expected
    assert not [
        t for t in set(threading.enumerate()) - threads_before if t.name == "AsyncEngineCore"
    ]


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import sys, anyio
    from asyncengine import AsyncLLM

    async def main():
        async with AsyncLLM.from_pretrained(sys.argv[1], **{kw}) as engine:
            print(engine._core_client.proc.pid, flush=True)
            await anyio.sleep_forever()

    if __name__ == "__main__":
        anyio.run(main)
    """
)


def test_core_exits_when_its_parent_is_killed(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT.replace("{kw}", repr(ENGINE_KW)))
    with subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama)], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            core = psutil.Process(int(parent.stdout.readline()))
            parent.send_signal(signal.SIGKILL)  # no clean-up code runs in the parent
            parent.wait(10)
            # The core notices (parent sentinel / getppid) and shuts down by itself.
            core.wait(15)
        finally:
            parent.kill()


def _run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )


def test_client_side_imports_no_torch_even_while_serving(tiny_llama: Path) -> None:
    # The engine core runs torch in its own process; the application's process stays light.
    code = textwrap.dedent(
        f"""
        import json, sys
        import anyio
        from asyncengine import AsyncLLM, SamplingParams
        heavy = ("torch", "transformers", "numpy", "triton")
        seen = {{"import": [m for m in heavy if m in sys.modules]}}

        async def main():
            engine = AsyncLLM.from_pretrained({str(tiny_llama)!r}, **{ENGINE_KW!r})
            seen["constructed"] = [m for m in heavy if m in sys.modules]
            async with engine:
                outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=4))]
                assert outs[-1].finished
                await engine.get_stats()
                seen["serving"] = [m for m in heavy if m in sys.modules]

        if __name__ == "__main__":
            anyio.run(main)
            print(json.dumps(seen))
        """
    )
    proc = _run_fresh(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"import": [], "constructed": [], "serving": []}


def test_uvloop_works(tiny_llama: Path) -> None:
    pytest.importorskip("uvloop")

    async def main() -> list[int]:
        async with AsyncLLM.from_pretrained(tiny_llama, core="process", **ENGINE_KW) as engine:
            outs = [o async for o in engine.generate("hello world", GREEDY)]
            await engine.check_health()
            return outs[-1].outputs[0].token_ids

    tokens = anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    assert len(tokens) == 8
    assert_gone(child_pids() - {os.getpid()}, timeout=5)
