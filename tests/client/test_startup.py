"""Start-up: a core that cannot start raises EngineStartupError with its root cause, within
seconds and without leaving a process; bad settings raise ValueError before anything starts."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import anyio
import pytest
from async_helpers import ENGINE_KW, assert_gone, child_pids

from asyncengine import AsyncLLM, EngineStartupError, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_weights(tiny_llama: Path, tmp_path: Path) -> Path:
    """A model folder with config and tokenizer but no weights: the core's loader fails."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for f in tiny_llama.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture
def bad_architecture(tiny_llama: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "bad-arch"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("core", ["process", "thread"])
async def test_missing_weights_raise_engine_startup_error(no_weights: Path, core: str) -> None:
    before = child_pids()
    start = time.monotonic()
    with anyio.fail_after(60), pytest.raises(EngineStartupError) as info:
        async with AsyncLLM.from_pretrained(no_weights, core=core, **ENGINE_KW):
            pytest.fail("the engine started without weights")
    message = str(info.value)
    assert "engine core failed to start" in message
    assert "OSError" in message or "safetensors" in message or "no file named" in message.lower()
    assert time.monotonic() - start < 60
    assert_gone(child_pids() - before)


async def test_exception_in_model_init_carries_the_root_cause(bad_architecture: Path) -> None:
    before = child_pids()
    with anyio.fail_after(60), pytest.raises(EngineStartupError, match="MadeUpForCausalLM"):
        async with AsyncLLM.from_pretrained(bad_architecture, **ENGINE_KW):
            pass
    assert_gone(child_pids() - before)


def test_bad_settings_raise_value_error_before_any_start(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        AsyncLLM.from_pretrained(tmp_path / "nowhere", device="cpu")
    with pytest.raises(ValueError, match="core="):
        AsyncLLM.from_pretrained(tiny_llama, device="cpu", core="cluster")
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLM.from_pretrained(tiny_llama, device="cpu", max_num_seqs=0)
    with pytest.raises(TypeError):
        AsyncLLM.from_pretrained(tiny_llama, device="cpu", no_such_setting=1)


async def test_engine_must_be_started_and_starts_once(tiny_llama: Path) -> None:
    engine = AsyncLLM.from_pretrained(tiny_llama, core="thread", **ENGINE_KW)
    with pytest.raises(RuntimeError, match="not started"):
        await engine.generate("hello").__anext__()
    with pytest.raises(RuntimeError, match="tokenizer"):
        _ = engine.tokenizer
    async with engine:
        outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
    with pytest.raises(RuntimeError, match="already started"):
        async with engine:
            pass
    from asyncengine import EngineDeadError

    with pytest.raises(EngineDeadError, match="closed"):
        await engine.generate("hello").__anext__()
    await engine.aclose()  # idempotent
