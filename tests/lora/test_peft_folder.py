"""PEFT folders checked against the base model before any weight is read: what an adapter
adapts, its ranks and scales (alpha / r, rsLoRA alpha / sqrt(r)), and a clear ValueError for
every folder the engine cannot serve."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncengine.config import EngineConfig, ModelConfig
from asyncengine.lora.peft_folder import check_peft_folder
from asyncengine.testing.lora import build_peft_adapter

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_config(tiny_llama: Path) -> ModelConfig:
    return EngineConfig.from_kwargs(tiny_llama, device="cpu", dtype="float32").model_config


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "qv"
    return build_peft_adapter(tiny_llama, folder, target_modules=["q_proj", "v_proj"], rank=8)


def _copy(adapter: Path, tmp_path: Path, **config_changes: object) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_peft_folder_lists_its_modules_ranks_and_scales(
    adapter: Path, model_config: ModelConfig
) -> None:
    checked = check_peft_folder("qv", str(adapter), model_config, max_lora_rank=64)
    layers = model_config.num_layers
    got = {(m.layer, m.module) for m in checked.modules}
    assert got == {(i, name) for i in range(layers) for name in ("q_proj", "v_proj")}
    assert {m.rank for m in checked.modules} == {8}
    assert {m.scale for m in checked.modules} == {16 / 8}  # lora_alpha / r
    assert checked.max_rank == 8


def test_rslora_scales_by_the_square_root_of_the_rank(
    tiny_llama: Path, model_config: ModelConfig, tmp_path: Path
) -> None:
    folder = build_peft_adapter(
        tiny_llama, tmp_path / "rs", target_modules=["o_proj"], rank=4, lora_alpha=6,
        use_rslora=True,
    )  # fmt: skip
    checked = check_peft_folder("rs", str(folder), model_config, max_lora_rank=64)
    assert {m.scale for m in checked.modules} == {6 / math.sqrt(4)}


def test_a_missing_folder_is_named(model_config: ModelConfig, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        check_peft_folder("x", str(tmp_path / "nowhere"), model_config, 64)


def test_a_folder_without_adapter_config_is_not_peft(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"not a PEFT folder: no adapter_config\.json"):
        check_peft_folder("x", str(tmp_path), model_config, 64)


def test_a_folder_without_safetensors_weights_is_not_peft(
    adapter: Path, model_config: ModelConfig, tmp_path: Path
) -> None:
    folder = _copy(adapter, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors"):
        check_peft_folder("x", str(folder), model_config, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not supported"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_alpha": 0}, "lora_alpha=0 is invalid"),
    ],
)
def test_options_the_engine_does_not_run_are_refused(
    adapter: Path,
    model_config: ModelConfig,
    tmp_path: Path,
    change: dict[str, object],
    message: str,
) -> None:
    folder = _copy(adapter, tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        check_peft_folder("x", str(folder), model_config, 64)


def test_a_rank_above_max_lora_rank_is_refused(adapter: Path, model_config: ModelConfig) -> None:
    with pytest.raises(ValueError, match=r"rank 8, above max_lora_rank=4"):
        check_peft_folder("qv", str(adapter), model_config, max_lora_rank=4)


def test_an_adapter_of_other_shapes_is_refused(
    tiny_model_factory: Callable[..., Path], model_config: ModelConfig, tmp_path: Path
) -> None:
    wider = tiny_model_factory("llama", hidden_size=32)
    folder = build_peft_adapter(wider, tmp_path / "wide", target_modules=["q_proj"], rank=4)
    with pytest.raises(ValueError, match="an adapter for another model"):
        check_peft_folder("wide", str(folder), model_config, 64)


def test_an_adapter_of_more_layers_is_refused(
    tiny_model_factory: Callable[..., Path], model_config: ModelConfig, tmp_path: Path
) -> None:
    deeper = tiny_model_factory("llama", num_hidden_layers=3)
    folder = build_peft_adapter(deeper, tmp_path / "deep", target_modules=["v_proj"], rank=4)
    with pytest.raises(ValueError, match="is for layer 2, but the base model has 2 layers"):
        check_peft_folder("deep", str(folder), model_config, 64)


def test_an_adapter_on_the_lm_head_is_refused(
    tiny_llama: Path, model_config: ModelConfig, tmp_path: Path
) -> None:
    folder = build_peft_adapter(
        tiny_llama, tmp_path / "head", target_modules=["q_proj", "lm_head"], rank=4
    )
    with pytest.raises(ValueError, match="not the embeddings or the lm_head"):
        check_peft_folder("head", str(folder), model_config, 64)
