"""collective_rpc: a worker extension's methods (`worker_extension_cls`) on every worker, one
result each in rank order; anything else refused with a clear error, and the engine serves on
after every error."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from async_helpers import ENGINE_KW

from asyncengine import LLM, AsyncLLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.testing.worker_extension import PATH

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
KW = dict(ENGINE_KW, worker_extension_cls=PATH)


async def _serves(engine: AsyncLLM) -> None:
    outs = [out async for out in engine.generate("hello", GREEDY)]
    assert len(outs[-1].outputs[0].token_ids) == 4


async def test_thread_core_calls_the_extension_and_refuses_the_rest(tiny_llama: Path) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **KW) as engine:
        [info] = await engine.collective_rpc("worker_info")
        assert info["rank"] == 0 and info["device"] == "cpu"
        # As a worker process would see them: what msgpack gives back (tuples as lists).
        echoed = await engine.collective_rpc("echo", args=(1, "a", (2, 3)), kwargs={"k": None})
        assert echoed == [{"rank": 0, "args": [1, "a", [2, 3]], "kwargs": {"k": None}}]

        with pytest.raises(ValueError, match=r"'no_such_method'.*echo.*worker_info"):
            await engine.collective_rpc("no_such_method")
        await _serves(engine)
        for internal in ("execute_model", "load_model", "sleep", "call_extension", "__init__"):
            with pytest.raises(ValueError, match=f"unknown method '{internal}'"):
                await engine.collective_rpc(internal)
        await _serves(engine)
        with pytest.raises(TypeError, match=r"collective_rpc\('echo'\).*encode"):
            await engine.collective_rpc("echo", args=(object(),))
        with pytest.raises(TypeError, match=r"collective_rpc\('echo'\).*encode"):
            await engine.collective_rpc("echo", kwargs={"x": 1j})
        await _serves(engine)
        with pytest.raises(TypeError, match=r"'unencodable'.*cannot encode"):
            await engine.collective_rpc("unencodable")
        await _serves(engine)
        with pytest.raises(RuntimeError, match="boom"):
            await engine.collective_rpc("fail", args=("boom",))
        await _serves(engine)


async def test_a_call_past_its_timeout_raises_and_the_engine_serves_on(tiny_llama: Path) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **KW) as engine:
        with pytest.raises(TimeoutError, match="'slow'"):
            await engine.collective_rpc("slow", args=(1.0,), timeout=0.2)
        # The in-process worker finishes the abandoned call, then serves.
        await _serves(engine)
        assert await engine.collective_rpc("slow", args=(0.0,), timeout=5.0) == [0]


async def test_without_an_extension_nothing_but_the_allowlist_is_callable(
    tiny_llama: Path,
) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        with pytest.raises(ValueError, match="no worker_extension_cls is configured"):
            await engine.collective_rpc("worker_info")
        [pid] = await engine.collective_rpc("pid")
        assert isinstance(pid, int)


async def test_tensor_parallel_workers_in_processes_answer_one_each(tiny_llama: Path) -> None:
    kw = dict(KW, tensor_parallel_size=2, distributed_executor_backend="mp", num_kv_blocks=128)
    async with AsyncLLM.from_pretrained(tiny_llama, core="process", **kw) as engine:
        infos = await engine.collective_rpc("worker_info")
        assert [i["rank"] for i in infos] == [0, 1]
        assert all(i["device"] == "cpu" for i in infos)
        assert len({i["pid"] for i in infos}) == 2
        echoed = await engine.collective_rpc("echo", args=("x",), kwargs={"n": 2})
        assert [e["args"] for e in echoed] == [["x"], ["x"]]
        with pytest.raises(ValueError, match="'execute_model'"):
            await engine.collective_rpc("execute_model")
        with pytest.raises(TypeError, match="'unencodable'"):
            await engine.collective_rpc("unencodable")
        with pytest.raises(RuntimeError, match="boom"):
            await engine.collective_rpc("fail", args=("boom",))
        await _serves(engine)
        with pytest.raises(TimeoutError, match="'slow'"):
            await engine.collective_rpc("slow", args=(1.0,), timeout=0.2)
        # The workers finish the abandoned call; its late answers are dropped.
        await _serves(engine)
        assert await engine.collective_rpc("slow", args=(0.0,)) == [0, 1]


async def test_data_parallel_ranks_each_run_the_call(tiny_llama: Path, tmp_path: Path) -> None:
    """With two data-parallel engine cores, every rank's worker runs the call; the list is
    the first live rank's (as vLLM)."""
    kw = dict(KW, data_parallel_size=2, num_kv_blocks=64)
    async with AsyncLLM.from_pretrained(tiny_llama, core="process", **kw) as engine:
        [pid] = await engine.collective_rpc("record", args=(str(tmp_path),))
        names = await anyio.to_thread.run_sync(os.listdir, tmp_path)
        recorded = sorted(int(name.removeprefix("pid-")) for name in names)
        assert len(recorded) == 2 and pid in recorded
        [info] = await engine.collective_rpc("worker_info")
        assert info["pid"] == pid and info["rank"] == 0
        with pytest.raises(ValueError, match="'execute_model'"):
            await engine.collective_rpc("execute_model")
        with pytest.raises(RuntimeError, match="boom"):
            await engine.collective_rpc("fail", args=("boom",))
        await _serves(engine)


def test_the_offline_llm_calls_the_extension(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, **KW)
    try:
        [info] = llm.collective_rpc("worker_info")
        assert info["rank"] == 0
        with pytest.raises(ValueError, match="'load_model'"):
            llm.collective_rpc("load_model")
        with pytest.raises(TypeError, match="'echo'"):
            llm.collective_rpc("echo", args=(object(),))
        assert llm.generate(["hi"], GREEDY, use_tqdm=False)[0].finished
    finally:
        llm.shutdown()


def test_a_bad_extension_path_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="worker_extension_cls='not a path'"):
        EngineConfig.from_kwargs(tiny_llama, device="cpu", worker_extension_cls="not a path")


async def test_an_extension_that_cannot_be_imported_fails_start_up(tiny_llama: Path) -> None:
    from asyncengine.errors import EngineStartupError

    kw = dict(ENGINE_KW, worker_extension_cls="no_such_module_here:Ext")
    with pytest.raises(EngineStartupError, match="no_such_module_here"):
        async with AsyncLLM.from_pretrained(tiny_llama, core="process", **kw):
            pass
