"""LoRAManager's loads for the native decode call: each adapter's descriptor table (in bf16 for
a bf16 model), and unloaded adapters' memory kept until the next step has waited for the work
pool's helpers (one preempted inside a LoRA item may still read it: kernels/csrc/pool.c)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.kernels.lora import LORA_FIELDS, LORA_GROUPS
from asyncengine.testing.lora import build_peft_adapter
from asyncengine.worker import lora_manager
from asyncengine.worker.lora_manager import LoRAManager

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_tables_and_retired_adapters(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    model_config = EngineConfig.from_kwargs(tiny_llama, device="cpu").model_config
    modules = {"attn": ["q_proj", "v_proj"], "mlp": ["down_proj"]}
    folders = {
        n: build_peft_adapter(tiny_llama, tmp_path / n, target_modules=m)
        for n, m in modules.items()
    }
    quiesced: list[int] = []
    monkeypatch.setattr(lora_manager, "quiesce_pool", lambda: quiesced.append(1))
    manager = LoRAManager(model_config, max_loaded=1, max_lora_rank=16, dtype=dtype)

    manager.add("attn", str(folders["attn"]))
    attn = manager.loaded["attn"]
    table = attn.native_table
    assert table is not None
    assert table.shape == (model_config.num_layers, len(LORA_GROUPS), LORA_FIELDS)
    qkv, o_proj = LORA_GROUPS.index("qkv"), LORA_GROUPS.index("o_proj")
    first = table[0, qkv].tolist()
    assert first[1] == 16  # q's rank 8 and v's stacked
    assert first[2] == (1 if dtype == torch.bfloat16 else 0)  # the weights' dtype code
    assert first[6] == 0 and first[9] != 0  # k not adapted, v is
    assert not table[:, o_proj].any()  # o_proj not adapted: no descriptor

    # "mlp" evicts "attn" (max_loaded=1): its memory stays until the next step has quiesced
    manager.add("mlp", str(folders["mlp"]))
    assert list(manager.loaded) == ["mlp"] and manager._retired == [attn]
    batch = manager.step_batch(["mlp", None], [1, 1])
    assert quiesced == [1] and manager._retired == []
    assert batch is not None and batch.native_segments() is not None
    manager.remove("mlp")
    assert len(manager._retired) == 1
    assert manager.step_batch([None], [1]) is None and quiesced == [1, 1]
