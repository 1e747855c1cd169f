"""The GPU options of every command: `--gpu-memory-utilization FRACTION` and `--enforce-eager`
reach the engine's config, a bad value is one line naming it before anything loads, and so is
asking for more ranks x workers than there are GPUs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import asyncengine.gpus as gpus_module
from asyncengine.config import EngineConfig
from asyncengine.entrypoints import cli, cli_checks

pytestmark = pytest.mark.timeout(60)

COMMANDS = [["demo"], ["generate", "some/model", "Hello"], ["serve", "some/model"]]


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", COMMANDS)
def test_gpu_flags_map_to_engine_keywords(command: list[str]) -> None:
    args = _parse(*command, "--gpu-memory-utilization", "0.4", "--enforce-eager")
    assert cli.engine_kwargs_from_args(args) == {
        "gpu_memory_utilization": 0.4,
        "enforce_eager": True,
    }
    assert cli.engine_kwargs_from_args(_parse(*command)) == {}  # the config's defaults apply


def test_gpu_flags_reach_the_engine_config(tiny_llama: Path) -> None:
    args = _parse("generate", str(tiny_llama), "Hello", "--device", "cpu",
                  "--gpu-memory-utilization", "0.4", "--enforce-eager")  # fmt: skip
    config = EngineConfig.from_kwargs(tiny_llama, **cli.engine_kwargs_from_args(args))
    assert config.cache_config.gpu_memory_utilization == 0.4
    assert config.model_config.enforce_eager is True
    defaults = EngineConfig.from_kwargs(tiny_llama, device="cpu")
    assert defaults.cache_config.gpu_memory_utilization == 0.9
    assert defaults.model_config.enforce_eager is False


def test_help_describes_the_gpu_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("serve", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu-memory-utilization FRACTION" in out and "(default: 0.9)" in out
    assert "--enforce-eager" in out and "CUDA graphs" in out


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "nan", "inf"])
def test_a_bad_gpu_memory_utilization_is_a_one_line_error(
    value: str, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(tiny_llama), "hello", "--device", "cpu",
            "--gpu-memory-utilization", value]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"asyncengine: error: gpu_memory_utilization={float(value)!r} is invalid")
    assert "at most 1" in err


def test_a_gpu_memory_utilization_that_is_not_a_number_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse("generate", "m", "p", "--gpu-memory-utilization", "most")
    assert info.value.code == 2
    assert "--gpu-memory-utilization: invalid float value: 'most'" in capsys.readouterr().err


def test_enforce_eager_takes_no_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.engine_kwargs_from_args(_parse("demo", "--enforce-eager")) == {"enforce_eager": True}
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--enforce-eager", "false"])
    assert info.value.code == 2
    assert "unrecognized arguments: false" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_more_ranks_than_gpus_is_a_one_line_error(
    command: str, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """One GPU, two ranks: refused before anything loads, naming the numbers (the check of
    --device itself is set aside: this torch may have no CUDA)."""
    monkeypatch.setattr(cli_checks, "check_device", lambda device: None)
    monkeypatch.setattr(gpus_module, "_nvidia_gpus", lambda: [""])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    where = ["hello"] if command == "generate" else ["--port", "0"]
    argv = [command, str(tiny_llama), *where, "--device", "cuda", "--data-parallel-size", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        "asyncengine: error: data_parallel_size=2 x tensor_parallel_size=1 needs 2 GPUs, "
        "but 1 is visible"
    )
