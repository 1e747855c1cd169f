"""Prepacked oneDNN linears: F.linear's numbers (to the bit from oneDNN, to the summation order
from the native decode-sized kernel), and the engine uses them in bf16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import LLM, SamplingParams
from asyncengine.kernels.cpu_native import load_native
from asyncengine.kernels.rms_norm_cpu import rms_norm_cpu
from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu
from asyncengine.model.cpu_forward import CpuForward
from asyncengine.model.cpu_linear import NATIVE_MAX_ROWS, PackedLinear, pack_linear_layers

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
)


def _native_routes() -> bool:
    lib = load_native()
    return lib is not None and lib.linear_bf16_fast


@pytest.mark.parametrize(
    "shape", [(1, 256), (7, 256), (1, 5, 256), (0, 256), (NATIVE_MAX_ROWS + 1, 256), (300, 256)]
)
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g))
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert (packed._native is not None) == _native_routes()
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
    rows = x.numel() // 256
    if packed._native is None or not 0 < rows <= packed.native_max_rows:
        assert torch.equal(got, want)  # oneDNN's kernel either way
    else:  # the native kernel: fp32 sums in another blocking, the rare last-bit difference
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
        assert (got != want).float().mean() < 0.01


@pytest.mark.skipif(not _native_routes(), reason="the native kernel's fast path is not built")
@pytest.mark.parametrize("bias", [True, False])
def test_fused_gate_up_silu_is_the_two_steps_bit_for_bit(bias: bool) -> None:
    # A joint [gate; up] layer's silu_mul(x) against its product then silu_mul_cpu, on
    # decode-sized batches (1-128 rows), with large values (SiLU's exp clamps) and strided rows.
    g = torch.Generator().manual_seed(5)
    inter, k = 192, 200
    linear = nn.Linear(k, 2 * inter, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(2 * inter, k, generator=g) * 0.5)
        if bias:
            linear.bias.copy_(torch.randn(2 * inter, generator=g) * 4)
    packed = PackedLinear(linear)
    limit = packed.native_max_rows  # NATIVE_MAX_ROWS (fewer on CPUs with AMX)
    for rows in (r for r in (1, 2, 5, 6, 7, 13, 64, NATIVE_MAX_ROWS) if r <= limit):
        wide = (torch.randn(rows, k + 3, generator=g) * 3).to(torch.bfloat16)
        x = wide[:, 1 : 1 + k]
        with torch.inference_mode():
            got = packed.silu_mul(x)
            both = packed(x)
            want = silu_mul_cpu(both[:, :inter], both[:, inter:])
        assert got is not None and torch.equal(got, want), rows
    # Where it does not apply it says so, and the caller runs the two steps.
    with torch.inference_mode():
        assert packed.silu_mul(torch.zeros(limit + 1, k, dtype=torch.bfloat16)) is None
        odd = PackedLinear(nn.Linear(k, 2 * 96, dtype=torch.bfloat16))  # halves of 1.5 blocks
        assert odd.silu_mul(torch.zeros(3, k, dtype=torch.bfloat16)) is None


@pytest.mark.skipif(not _native_routes(), reason="the native kernel's fast path is not built")
@pytest.mark.parametrize(("n", "bias"), [(576, False), (1024, True), (80, False)])
def test_fused_projection_add_rms_norm_is_the_two_steps_bit_for_bit(n: int, bias: bool) -> None:
    # A projection's add_rms_norm(x, residual, ...) against its product then rms_norm_cpu:
    # the same normed rows and the same residual afterwards, bit for bit, on 1-128 rows with a
    # residual whose rows are strided.
    g = torch.Generator().manual_seed(7)
    k = 160
    linear = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.2)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    packed = PackedLinear(linear)
    weight = (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16)
    limit = packed.native_max_rows  # NATIVE_MAX_ROWS (fewer on CPUs with AMX)
    for rows in (r for r in (1, 2, 7, 64, NATIVE_MAX_ROWS) if r <= limit):
        x = (torch.randn(rows, k, generator=g) * 2).to(torch.bfloat16)
        wide = (torch.randn(rows, n + 8, generator=g) * 4).to(torch.bfloat16)
        got_res, want_res = wide.clone()[:, :n], wide.clone()[:, :n]
        with torch.inference_mode():
            got = packed.add_rms_norm(x, got_res, weight, 1e-5)
            want = rms_norm_cpu(packed(x), weight, 1e-5, want_res)
        assert got is not None and torch.equal(got, want), rows
        assert torch.equal(got_res, want_res), rows
    with torch.inference_mode():  # where it does not apply it says so
        big = torch.zeros(limit + 1, k, dtype=torch.bfloat16)
        res = torch.zeros(limit + 1, n, dtype=torch.bfloat16)
        assert packed.add_rms_norm(big, res, weight, 1e-5) is None
        assert packed.add_rms_norm(big[:3], res[:3].float(), weight, 1e-5) is None


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
        llm = LLM(model_dir, device="cpu", dtype="bfloat16")
        runner = llm.engine.engine_core.executor.worker.model_runner
        # The lean CPU forward, loaded straight from the checkpoint, holds the layers.
        assert isinstance(runner.model, CpuForward)
        layers = runner.model.linear_layers()
        packed = sum(isinstance(m, PackedLinear) for m in layers)
        outs = llm.generate(prompts, params, use_tqdm=False)
        logprobs = [next(iter(o.outputs[0].logprobs[-1].values())).logprob for o in outs]
        return [o.outputs[0].token_ids for o in outs], logprobs, packed

    tokens, logprobs, packed = run()
    assert packed > 0
    monkeypatch.setattr("asyncengine.model.cpu_linear._PACKABLE", ())
    plain_tokens, plain_logprobs, plain_packed = run()
    assert plain_packed == 0
    assert tokens == plain_tokens
    # Decode-sized products run in the native kernel, whose sums may round a last bit apart.
    assert logprobs == pytest.approx(plain_logprobs, abs=0.02)
