"""The embedded default model's folder: its sampling defaults (the GGUF file carries none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine.config import EngineConfig
from asyncengine.entrypoints import default_model

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
    defaults = dict(EngineConfig.from_kwargs(folder).model_config.sampling_defaults)
    assert defaults == {"temperature": 0.2, "top_p": 0.9}
