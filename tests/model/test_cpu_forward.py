"""The lean CPU forward (`model/cpu_forward.py`) and the fused kernels it runs on.

Its contract: the same numbers as the model running through transformers' own forward on the
same attention backend. The kernels round where transformers' op chains round, so engines with
and without it give the same tokens and logprobs, to the bit, in fp32 and bf16.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asyncengine import LLM, SamplingParams
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.lm_head_argmax_cpu import LmHeadArgmax
from asyncengine.model import cpu_checkpoint, cpu_forward
from asyncengine.model.transformers_model import TransformersModel
from asyncengine.testing.models import TINY_ARCHITECTURES
from asyncengine.testing.reference import engine_tokens_and_logprobs

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())


def _prompts() -> list[list[int]]:
    shared = list(range(20, 60))
    return [[7], [*shared, 61, 62, 63], list(range(100, 131)), [*shared, 90], [300, 301, 5]]


def _run(model_dir: Path, dtype: str) -> list[tuple[list[int], list[list[float]]]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    # A small token budget chunks the long prompts and runs decodes next to prefill chunks;
    # the second pass hits the prefix cache.
    return engine_tokens_and_logprobs(
        model_dir, _prompts(), params, passes=2,
        dtype=dtype, max_num_batched_tokens=16, num_kv_blocks=32,
    )  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_the_same_numbers_with_and_without_it(
    arch: str,
    dtype: str,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Three ways to run one checkpoint, the same numbers: the lean forward built straight from
    the checkpoint (the default), the lean forward over transformers' loaded model, and
    transformers' own forward."""
    model_dir = shutil.copytree(tiny_model_factory(arch), tmp_path / arch)
    _perturb_vectors(model_dir)
    built: list[cpu_forward.CpuForward] = []
    real_init = cpu_forward.CpuForward.__init__

    def spy(self: cpu_forward.CpuForward, **parts: Any) -> None:
        real_init(self, **parts)
        built.append(self)

    monkeypatch.setattr(cpu_forward.CpuForward, "__init__", spy)
    loads: list[object] = []
    real_load = cpu_checkpoint.load_cpu_forward
    monkeypatch.setattr(
        cpu_checkpoint, "load_cpu_forward", lambda config: loads.append(config) or real_load(config)
    )
    from_checkpoint = _run(model_dir, dtype)
    assert len(built) == 1 and len(loads) == 1
    # Joint q/k/v and gate/up projections in every layer, for bf16 only (see joint_weights).
    joined = dtype == "bfloat16"
    for layer in built[0]._layers:
        assert (layer.qkv is not None, layer.gate_up is not None) == (joined, joined)
    monkeypatch.setattr(cpu_checkpoint, "lean_checkpoint_reason", lambda config: "switched off")
    assert _run(model_dir, dtype) == from_checkpoint
    assert len(built) == 2 and len(loads) == 1
    for layer in built[1]._layers:
        assert (layer.qkv is not None, layer.gate_up is not None) == (joined, joined)
    monkeypatch.setattr(cpu_forward, "unsupported_reason", lambda model: "switched off")
    assert _run(model_dir, dtype) == from_checkpoint
    assert len(built) == 2


def _perturb_vectors(model_dir: Path) -> None:
    """Random norm weights and biases (the tiny builder leaves them ones and zeros)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(9)
    for name, t in tensors.items():
        if t.dim() == 1:
            noise = torch.randn(t.shape, generator=g) * (0.1 if "bias" in name else 0.2)
            tensors[name] = (t.float() + noise).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_models_it_does_not_take_run_through_transformers(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama", hidden_act="gelu")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert "SiLU" in (cpu_forward.unsupported_reason(model) or "")
    assert "architecture" in (cpu_forward.unsupported_reason(nn.Linear(2, 2)) or "")
    llm = LLM(model_dir, device="cpu", dtype="float32")
    try:
        runner = llm.engine.engine_core.executor.worker.model_runner  # type: ignore[attr-defined]
        assert isinstance(runner.model, TransformersModel)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_projections_are_joined_only_when_that_changes_nothing() -> None:
    torch.manual_seed(0)
    plain = [nn.Linear(16, 8, dtype=torch.bfloat16), nn.Linear(16, 4, dtype=torch.bfloat16)]
    joint = cpu_forward._joint(plain)  # type: ignore[arg-type]
    assert joint is not None and joint.out_features == 12
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(joint(x), torch.cat([p(x) for p in plain], dim=-1))
    # Biases on some parts only, or a part that is not a plain linear layer: left apart.
    mixed = [nn.Linear(16, 8, dtype=torch.bfloat16), nn.Linear(16, 4, bias=False)]
    assert cpu_forward._joint(mixed) is None  # type: ignore[arg-type]
    assert cpu_forward._joint([plain[0], nn.Identity()]) is None
    # fp32 GEMMs are not joined (MKL's kernels depend on the output width).
    assert cpu_forward._joint([nn.Linear(16, 8), nn.Linear(16, 4)]) is None  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_long_prefills_run_the_mlp_in_chunks_with_the_same_numbers(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1,100-token prefill step (MLP in row chunks) gives transformers' numbers."""
    assert cpu_forward._MLP_CHUNK_ROWS * 2 <= 1100
    model_dir = tiny_model_factory("qwen2", max_position_embeddings=1024)
    prompts = [list(range(3, 403)), [(i * 7) % 500 for i in range(700)]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)

    def run() -> list[tuple[list[int], list[list[float]]]]:
        return engine_tokens_and_logprobs(
            model_dir, prompts, params, dtype="bfloat16", max_num_batched_tokens=2048
        )

    chunked = run()
    monkeypatch.setattr(cpu_checkpoint, "lean_checkpoint_reason", lambda config: "switched off")
    monkeypatch.setattr(cpu_forward, "unsupported_reason", lambda model: "switched off")
    assert run() == chunked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_decodes_take_their_tokens_from_the_lm_head_screen(
    arch: str,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy rows and rows sampled by temperature alone skip the logits
    (kernels/lm_head_argmax_cpu.py) for the tokens the sampler would pick from them (a seeded
    request's, the same); rows with penalties or filters still get logits."""
    lib = load_native()
    if lib is None or not lib.linear_bf16_fast:
        pytest.skip("the native linear kernels are not built with AVX512-BF16")
    model_dir = tiny_model_factory(arch)
    calls: list[int] = []
    real = LmHeadArgmax.__call__

    def spy(self: LmHeadArgmax, hidden: torch.Tensor, *args: Any) -> torch.Tensor | None:
        calls.append(hidden.shape[0])
        return real(self, hidden, *args)

    monkeypatch.setattr(LmHeadArgmax, "__call__", spy)
    common: dict[str, Any] = dict(max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, **common)
    sampled = [SamplingParams(temperature=0.8, seed=i, **common) for i in range(len(_prompts()))]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, **common)
    filtered = SamplingParams(temperature=0.8, top_p=0.9, seed=1, **common)

    def tokens(params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        llm = LLM(
            model_dir, device="cpu", dtype="bfloat16", max_num_batched_tokens=16, num_kv_blocks=32
        )
        try:
            outs = llm.generate(_prompts(), params, use_tqdm=False)
            return [list(out.outputs[0].token_ids) for out in outs]
        finally:
            llm.shutdown()

    screened = []
    for params in (greedy, sampled):
        screened.append(tokens(params))
        assert calls and max(calls) <= 5
        calls.clear()
    tokens(penalised)
    tokens(filtered)
    assert not calls
    monkeypatch.setattr(cpu_forward, "_lm_head_argmax", lambda lm_head: None)
    assert [tokens(greedy), tokens(sampled)] == screened
    assert not calls
