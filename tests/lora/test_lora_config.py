"""The LoRA keywords of EngineConfig: defaults, and a ValueError naming each bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine import LoRARequest
from asyncengine.config import EngineConfig
from asyncengine.lora.request import LoRAConfig

pytestmark = pytest.mark.timeout(60)


def test_defaults() -> None:
    config = LoRAConfig()
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (False, 4, 64)
    assert config.loaded_limit == 4  # max_cpu_loras defaults to max_loras
    assert LoRAConfig(max_cpu_loras=9).loaded_limit == 9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_loras=0), "max_loras=0 is invalid"),
        (dict(max_lora_rank=-1), "max_lora_rank=-1 is invalid"),
        (dict(max_cpu_loras=0), "max_cpu_loras=0 is invalid"),
        (dict(max_loras=4, max_cpu_loras=2), r"must be >= max_loras \(4\)"),
        (dict(enable_lora="yes"), "enable_lora='yes'"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)  # type: ignore[arg-type]


def test_engine_keywords_reach_the_lora_config(tiny_llama: Path) -> None:
    config = EngineConfig.from_kwargs(
        tiny_llama, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=3,
        max_lora_rank=16,
    )  # fmt: skip
    assert config.lora_config == LoRAConfig(True, 2, 3, 16)


def test_a_lora_request_needs_a_name() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        LoRARequest("")
    assert LoRARequest("a", Path("/x")).path == "/x"
