"""Sharding a model for tensor parallelism, in one process (the TP=2 engine tests run it for
real): which layers split which way, with the model's TP plan or without one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from asyncengine.errors import UnsupportedModelError
from asyncengine.model.tensor_parallel import RowParallelLinear, shard_model


def _load(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model


@pytest.mark.parametrize("with_plan", [True, False])
def test_rank_1_of_2_holds_its_half_of_the_heads_and_the_mlp(
    with_plan: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    full = _load(tiny_model_factory("llama"))  # 4 heads, 2 KV heads, head_dim 16, MLP 128
    model = _load(tiny_model_factory("llama"))
    if not with_plan:
        model.config.base_model_tp_plan = None  # our default plan takes over
    shard_model(model, rank=1, world_size=2, all_reduce=lambda t: t)
    attn, full_attn = model.model.layers[0].self_attn, full.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (32, 64)  # query heads 2 and 3
    torch.testing.assert_close(attn.q_proj.weight, full_attn.q_proj.weight[32:])
    torch.testing.assert_close(attn.k_proj.weight, full_attn.k_proj.weight[16:])  # KV head 1
    assert isinstance(attn.o_proj, RowParallelLinear)
    torch.testing.assert_close(attn.o_proj.linear.weight, full_attn.o_proj.weight[:, 32:])
    mlp, full_mlp = model.model.layers[1].mlp, full.model.layers[1].mlp
    torch.testing.assert_close(mlp.up_proj.weight, full_mlp.up_proj.weight[64:])
    torch.testing.assert_close(mlp.down_proj.linear.weight, full_mlp.down_proj.weight[:, 64:])
    assert model.lm_head.weight.shape == full.lm_head.weight.shape  # replicated


def test_partial_sums_of_row_parallel_layers_add_up_to_the_full_layer() -> None:
    g = torch.Generator().manual_seed(0)
    full = nn.Linear(8, 6, bias=True)
    with torch.no_grad():
        full.weight.copy_(torch.randn(6, 8, generator=g))
        full.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(3, 8, generator=g)
    partials = []
    for rank in range(2):
        layer = RowParallelLinear(full, rank, 2, all_reduce=lambda t: t)
        partials.append(layer(x[:, rank * 4 : (rank + 1) * 4]) - full.bias)
    torch.testing.assert_close(sum(partials) + full.bias, full(x))


def test_an_unsupported_sharding_style_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    model = _load(tiny_model_factory("llama"))
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "local_packed_rowwise"}
    with pytest.raises(UnsupportedModelError, match="local_packed_rowwise"):
        shard_model(model, rank=0, world_size=2, all_reduce=lambda t: t)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
)
def test_cpu_weight_packing_reaches_the_row_parallel_layers(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from transformers import AutoModelForCausalLM

    from asyncengine.model.cpu_linear import PackedLinear, pack_linear_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama"), dtype=torch.bfloat16)
    shard_model(model, rank=0, world_size=2, all_reduce=lambda t: t)
    ids = torch.randint(4, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = model(ids).logits
        pack_linear_layers(model, torch.bfloat16)
        after = model(ids).logits
    assert isinstance(model.model.layers[0].self_attn.o_proj.linear, PackedLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj.linear, PackedLinear)
    assert torch.equal(before, after)
