"""Prepacked oneDNN linears: the same numbers as F.linear, and the engine uses them in bf16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import LLM, SamplingParams
from asyncengine.model.cpu_linear import PackedLinear, pack_linear_layers

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
)


@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (1, 5, 256), (0, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear_bitwise(shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g))
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


def test_only_half_precision_models_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert pack_linear_layers(model, torch.float32) == 0
    assert all(type(m) is nn.Linear for m in model)
    model = model.to(torch.bfloat16)
    assert pack_linear_layers(model, torch.bfloat16) == 2
    assert all(isinstance(m, PackedLinear) for m in model)


def test_bf16_engine_runs_packed_and_matches_unpacked(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_factory("qwen2")  # qwen2: biased q/k/v projections
    prompts = [[5, 9, 13, 200, 7], list(range(20, 90))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run() -> tuple[list[list[int]], list[float], int]:
        llm = LLM(model_dir, dtype="bfloat16")
        runner = llm.engine.engine_core.executor.worker.model_runner
        # The lean CPU forward, loaded straight from the checkpoint, holds the layers.
        layers = runner.cpu_forward.linear_layers()
        packed = sum(isinstance(m, PackedLinear) for m in layers)
        outs = llm.generate(prompts, params, use_tqdm=False)
        logprobs = [next(iter(o.outputs[0].logprobs[-1].values())).logprob for o in outs]
        return [o.outputs[0].token_ids for o in outs], logprobs, packed

    tokens, logprobs, packed = run()
    assert packed > 0
    monkeypatch.setattr("asyncengine.model.cpu_linear._PACKABLE", ())
    plain_tokens, plain_logprobs, plain_packed = run()
    assert plain_packed == 0
    assert tokens == plain_tokens and logprobs == plain_logprobs
