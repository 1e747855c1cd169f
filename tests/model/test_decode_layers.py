"""The decoder layers in one native call (`model/decode_layers.py`, `csrc/decode_layers.c`).

Its contract: `CpuForward`'s Python loop's numbers to the bit (the same kernels in the same
order), on the models and steps it takes, and the Python loop everywhere else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.kernels.cpu_native import CSRC, load_native
from asyncengine.kernels.decode_layers_cpu import LAYER_FIELDS
from asyncengine.kernels.linear_dense_cpu import dense_kernels
from asyncengine.model import cpu_forward, cpu_linear, decode_layers
from asyncengine.testing.models import TINY_ARCHITECTURES
from asyncengine.testing.reference import engine_tokens_and_logprobs


@pytest.fixture(autouse=True, params=["dense", "packed"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the bf16 layers run (the engines here run in-process, so the patches reach their
    loader): "dense", on the AVX2 dense kernel as on a CPU without AVX512-BF16, also where
    oneDNN could pack them; "packed", PackedLinear over linear.c's kernels (AVX512-BF16
    builds), on CPUs with AMX with its native row limit raised so that steps of several
    sequences run natively too (test_row_limit_is_the_packed_layers checks the real one)."""
    if request.param == "dense":
        if dense_kernels() is None:
            pytest.skip("the native kernels were built without AVX2 and FMA")
        monkeypatch.setattr(cpu_linear, "_packing_works", lambda dtype: False)
    else:
        lib = load_native()
        if lib is None or not lib.linear_bf16_fast:
            pytest.skip("the native kernel's fast path is not built (AVX512-BF16)")
        monkeypatch.setattr(cpu_linear, "NATIVE_MAX_ROWS_AMX", cpu_linear.NATIVE_MAX_ROWS)
    return str(request.param)


def test_layer_fields_are_the_headers() -> None:
    header = (CSRC / "ae_kernels.h").read_text()
    enum = re.search(r"enum ae_layer_field \{(.*?)\};", header, re.S)
    assert enum is not None
    names = [n.strip() for n in enum.group(1).split(",") if n.strip()]
    assert names[-1] == "AE_LAYER_FIELDS"
    assert [n.removeprefix("AE_LAYER_").lower() for n in names[:-1]] == list(LAYER_FIELDS)


class _Spy:
    """Counts the steps the native layers ran and the ones they handed back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ran = self.declined = 0
        self.token_counts: list[int] = []
        real = decode_layers.NativeDecodeLayers.__call__

        def call(layers: Any, residual: torch.Tensor, *args: Any) -> torch.Tensor | None:
            out = real(layers, residual, *args)
            if out is None:
                self.declined += 1
            else:
                self.ran += 1
                self.token_counts.append(residual.shape[0])
            return out

        monkeypatch.setattr(decode_layers.NativeDecodeLayers, "__call__", call)


def _prompts() -> list[list[int]]:
    shared = list(range(20, 60))
    return [[7], [*shared, 61, 62, 63], list(range(100, 131)), [*shared, 90], [300, 301, 5]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_native_layers_give_the_python_loops_numbers(
    arch: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens and logprobs, bf16, decodes beside prefill chunks and prefix-cache hits."""
    model_dir = tiny_model_factory(arch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    run = lambda: engine_tokens_and_logprobs(  # noqa: E731
        model_dir, _prompts(), params, passes=2,
        dtype="bfloat16", max_num_batched_tokens=16, num_kv_blocks=32,
    )  # fmt: skip
    spy = _Spy(monkeypatch)
    native = run()
    assert spy.ran > 10 and spy.declined == 0
    assert min(spy.token_counts) <= len(_prompts()) < max(spy.token_counts)  # decodes, mixed
    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "build", lambda *a: None)
    assert run() == native


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_layers_give_the_python_loops_numbers(
    arch: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantization="int8"` projections (Q8_0 kernels) beside the packed or dense lm_head."""
    _native_equals_loop(monkeypatch, tiny_model_factory(arch), _prompts(), quantization="int8")


@pytest.mark.timeout(300)
def test_a_gguf_mix_of_types_gives_the_python_loops_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A GGUF file of Q4_0 projections, Q8_0 v projections and F16 (packed or dense) down
    projections: every native format the build runs, side by side in the one call."""
    if route == "dense":
        pytest.skip("one route is enough: the float layers are the other test's")
    pytest.importorskip("gguf")
    from test_gguf_files import Q, write_tiny_gguf

    tiny = write_tiny_gguf(
        tmp_path / "mix.gguf", "qwen2", weight_type=Q.Q4_0, embed_type=Q.Q8_0, seed=2,
        type_overrides={"v_proj": Q.Q8_0, "down_proj": Q.F16},
    )  # fmt: skip
    prompts = [[t % 250 for t in p] for p in _prompts()]  # the tiny file's vocabulary: 268
    _native_equals_loop(monkeypatch, tiny.path, prompts)


def _native_equals_loop(
    monkeypatch: pytest.MonkeyPatch, model: Path, prompts: list[list[int]], **config: Any
) -> None:
    """Tokens and logprobs (bf16, decodes beside prefill chunks) with the native layers, which
    run every decode step, equal the Python loop's."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    # (steps of up to 15 tokens: quantized layers of blocks of 32 dequantize from 16 rows on,
    # in the Python loop)
    run = lambda: engine_tokens_and_logprobs(  # noqa: E731
        model, prompts, params, dtype="bfloat16", max_num_batched_tokens=15, num_kv_blocks=32,
        **config,
    )  # fmt: skip
    spy = _Spy(monkeypatch)
    native = run()
    assert spy.ran > 10 and spy.declined == 0
    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "build", lambda *a: None)
    assert run() == native


@pytest.mark.timeout(300)
def test_widths_off_the_fused_kernels_blocks(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hidden width that is not a multiple of 16 and an MLP width not of 64: on packed
    layers the products and norms run as separate calls there, still the loop's numbers."""
    model_dir = tiny_model_factory(
        "llama", hidden_size=72, intermediate_size=96, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    run = lambda: engine_tokens_and_logprobs(  # noqa: E731
        model_dir, _prompts(), params, dtype="bfloat16", max_num_batched_tokens=16
    )
    spy = _Spy(monkeypatch)
    native = run()
    assert spy.ran > 5 and spy.declined == 0
    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "build", lambda *a: None)
    assert run() == native


@pytest.mark.timeout(300)
def test_long_prefill_steps_run_the_python_loop(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of MAX_TOKENS tokens or more, or with a prefill chunk for SDPA, is handed back,
    and the decodes after it run natively; same numbers as the Python loop throughout."""
    model_dir = tiny_model_factory("qwen2")
    monkeypatch.setattr(decode_layers, "MAX_TOKENS", 40)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [list(range(10, 70)), [5, 6, 7]]  # 63 tokens in the first step
    spy = _Spy(monkeypatch)
    native = engine_tokens_and_logprobs(model_dir, prompts, params, dtype="bfloat16")
    assert spy.declined >= 1 and spy.ran >= 3
    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "build", lambda *a: None)
    assert engine_tokens_and_logprobs(model_dir, prompts, params, dtype="bfloat16") == native


@pytest.mark.timeout(120)
def test_it_takes_only_bf16_models_with_one_eps(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """fp32 weights, or layers that disagree on their norm's eps: the Python loop."""
    model_dir = tiny_model_factory("llama")
    for dtype, expect in (("bfloat16", True), ("float32", False)):
        llm = LLM(str(model_dir), device="cpu", dtype=dtype)
        try:
            forward: Any = llm.engine.engine_core.executor.worker.model_runner.model
            assert isinstance(forward, cpu_forward.CpuForward)
            assert (forward.native_layers is not None) == expect
            if expect:
                layers = forward._layers
                layers[1].eps *= 2
                assert decode_layers.NativeDecodeLayers.build(layers, forward._head_dim) is None
                layers[1].eps /= 2
                assert decode_layers.NativeDecodeLayers.build(layers, forward._head_dim)
        finally:
            llm.shutdown()


@pytest.mark.timeout(300)
def test_a_new_kv_cache_after_sleep_is_the_one_written(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """The caches' addresses are read each step: after sleep (which frees the KV cache) and
    wake-up (a new one), the same prompts give the same tokens."""
    llm = LLM(str(tiny_model_factory("llama")), device="cpu", dtype="bfloat16")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        before = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        core: Any = llm.engine.engine_core  # in-process: its sleep is the worker's
        core.sleep(1)
        core.wake_up()
        after = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        assert after == before
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_row_limit_is_the_packed_layers(
    route: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On packed layers it runs steps of at most the rows their native kernel takes (4 with
    AMX, where oneDNN's tile kernels win from a few rows up); else up to MAX_TOKENS - 1."""
    if route == "packed":
        monkeypatch.setattr(cpu_linear, "NATIVE_MAX_ROWS_AMX", 4)
    llm = LLM(str(tiny_model_factory("llama")), device="cpu", dtype="bfloat16")
    try:
        forward: Any = llm.engine.engine_core.executor.worker.model_runner.model
        native = forward.native_layers
        assert native is not None
        if route == "dense":
            assert native.max_tokens == decode_layers.MAX_TOKENS - 1
            return
        rows = {layer.native_max_rows for layer in forward.linear_layers()}
        assert native.max_tokens == min(decode_layers.MAX_TOKENS - 1, *rows)
    finally:
        llm.shutdown()
