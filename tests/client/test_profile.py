"""start_profile / stop_profile: torch.profiler in every worker, one chrome trace (JSON) per
worker in the folder the caller names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from async_helpers import ENGINE_KW

from asyncengine import LLM, AsyncLLM, SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _traces(folder: Path) -> list[Path]:
    traces = sorted(folder.glob("*.pt.trace.json"))
    for trace in traces:
        assert "traceEvents" in json.loads(trace.read_text())
    return traces


async def _profile(engine: AsyncLLM, folder: Path) -> None:
    await engine.start_profile(folder)
    outs = [out async for out in engine.generate("hello", GREEDY)]
    assert outs[-1].finished
    await engine.stop_profile()


async def test_a_profile_writes_a_trace_and_misuse_is_refused(
    tiny_llama: Path, tmp_path: Path
) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW) as engine:
        with pytest.raises(ValueError, match="profile_dir"):
            await engine.start_profile()
        with pytest.raises(RuntimeError, match="no profile is running"):
            await engine.stop_profile()
        folder = tmp_path / "traces"  # made by start_profile
        await engine.start_profile(folder)
        with pytest.raises(RuntimeError, match="already running"):
            await engine.start_profile(folder)
        assert [out async for out in engine.generate("hello", GREEDY)][-1].finished
        await engine.stop_profile()
        [trace] = _traces(folder)
        assert trace.name.startswith("dp0-tp0.")
        # The engine serves on, and profiles again (into a new file).
        await _profile(engine, folder)
        assert len(_traces(folder)) == 2


async def test_every_tensor_parallel_worker_writes_its_trace(
    tiny_llama: Path, tmp_path: Path
) -> None:
    kw = dict(ENGINE_KW, tensor_parallel_size=2, distributed_executor_backend="mp")
    async with AsyncLLM.from_pretrained(tiny_llama, core="process", **kw) as engine:
        await _profile(engine, tmp_path)
    traces = _traces(tmp_path)
    assert [t.name.partition(".")[0] for t in traces] == ["dp0-tp0", "dp0-tp1"]


def test_the_offline_llm_profiles(tiny_llama: Path, tmp_path: Path) -> None:
    llm = LLM(tiny_llama, **ENGINE_KW)
    try:
        with pytest.raises(ValueError, match="profile_dir"):
            llm.start_profile()
        llm.start_profile(tmp_path)
        llm.generate(["hi"], GREEDY, use_tqdm=False)
        [path] = llm.stop_profile()
        assert _traces(tmp_path) == [Path(path)]
    finally:
        llm.shutdown()
