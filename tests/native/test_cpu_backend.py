"""The "cpu" backend (native kernels) through the whole engine, and its fused ops in models.

On a CPU device `attention_backend="auto"` means "cpu": greedy tokens must equal transformers'
(fp32) with every attention path in play, and the fused RMSNorm / SiLU-and-multiply must keep
the model's logits. Where the kernels can't be built the backend is the torch reference.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.kernels import cpu_native
from asyncengine.kernels.fused_cpu import rms_norm_cpu, silu_mul_cpu
from asyncengine.model import attention
from asyncengine.model.attention import AttentionBackend, get_backend
from asyncengine.model.fused_ops import use_native_cpu_ops
from asyncengine.testing import transformers_greedy

pytestmark = pytest.mark.skipif(cpu_native.load_native() is None, reason="no working C compiler")

CPU = torch.device("cpu")
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(4, 500, (40,), generator=g).tolist()
    tails = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (1, 5, 37)]
    return [[9], shared + tails[0], shared + tails[1], shared + tails[2], tails[2]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_auto_on_cpu_uses_native_kernels_and_matches_transformers(
    arch: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []

    def spy(name: str, device: torch.device) -> AttentionBackend:
        backend = get_backend(name, device)
        used.append(backend.name)
        return backend

    monkeypatch.setattr(attention, "get_backend", spy)
    model_dir = tiny_model_factory(arch)
    expected = transformers_greedy(model_dir, _prompts(), NEW_TOKENS)
    # A small token budget splits the long prompts into chunks over a cached prefix; the
    # second pass hits the prefix cache; decodes run next to prefills.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=24, num_kv_blocks=40)
    for _ in range(2):
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert set(used) == {"cpu"}
    assert llm.statistics().prefix_cache_hits > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3 also normalises q and k per head
def test_fused_ops_keep_the_logits(arch: str, tiny_model_factory: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32)
    model.eval()
    ids = torch.randint(4, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits
        layers = model.config.num_hidden_layers
        norms, mlps = use_native_cpu_ops(model)
        got = model(ids).logits
    assert norms == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert mlps == layers
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_ops_match_torch(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (torch.randn(37, 2, 96, generator=g) * 3).to(dtype)
    gate = (torch.randn(37, 200, generator=g) * 4).to(dtype)
    up = torch.randn(37, 200, generator=g).to(dtype)
    strided = x[:, 1]  # rows 192 elements apart
    got_norm, want_norm = rms_norm_cpu(strided, norm.weight, 1e-6), norm(strided)
    got_act, want_act = silu_mul_cpu(gate, up), torch.nn.functional.silu(gate) * up
    if dtype == torch.bfloat16:  # same roundings in the same places: bit for bit
        assert torch.equal(got_norm, want_norm) and torch.equal(got_act, want_act)
    else:  # fp32: another summation order; fp16: a rare last-bit difference
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got_norm, want_norm, atol=tol, rtol=tol)
        torch.testing.assert_close(got_act, want_act, atol=tol, rtol=tol)


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(cpu_native.DISABLE_ENV, "0")
    cpu_native.load_native.cache_clear()
    attention._cpu_backend.cache_clear()
    yield
    cpu_native.load_native.cache_clear()
    attention._cpu_backend.cache_clear()


@pytest.mark.usefixtures("no_native")
def test_without_native_kernels_cpu_is_the_torch_reference() -> None:
    assert get_backend("cpu", CPU).name == "torch"
    assert use_native_cpu_ops(torch.nn.Linear(2, 2)) == (0, 0)


def test_cpu_backend_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on CPU devices only"):
        get_backend("cpu", torch.device("cuda"))


def test_config_resolves_and_checks_the_cpu_backend(tiny_llama: Path) -> None:
    from asyncengine.config import EngineConfig

    assert EngineConfig.from_kwargs(tiny_llama).model_config.attention_backend == "cpu"
    explicit = EngineConfig.from_kwargs(tiny_llama, attention_backend="torch")
    assert explicit.model_config.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on CPU devices only"):
        EngineConfig.from_kwargs(tiny_llama, device="cuda", attention_backend="cpu")


def test_build_is_cached_per_source_and_a_broken_compiler_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None and lib.path.parent == tmp_path / "native"
        assert [p.name for p in lib.path.parent.iterdir()] == [lib.path.name]  # no temp file
        cpu_native.load_native.cache_clear()
        again = cpu_native.load_native()  # found in the cache: no rebuild
        assert again is not None and again.path == lib.path
        # A compiler that fails (and no cached library for this new "compiler"): torch path.
        monkeypatch.setenv("CC", "false")
        monkeypatch.setattr(cpu_native, "_compiler_identity", lambda cc: b"broken")
        cpu_native.load_native.cache_clear()
        with caplog.at_level("WARNING"):
            assert cpu_native.load_native() is None
        assert "building the native CPU kernels failed" in caplog.text
    finally:
        cpu_native.load_native.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_argmax_is_torch_argmax(dtype: torch.dtype) -> None:
    from asyncengine.kernels.fused_cpu import argmax_cpu

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 1000, generator=g) * 0.01).to(dtype)  # many ties in half precision
    x[1, 7] = x[1, 900] = float("nan")  # the first NaN wins, as in torch
    x[2, 999] = float("nan")  # a NaN in the tail, past the last full 16 lanes
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 998] = 1e4  # the maximum in the tail
    for rows in (x, x[:, 3:], x[:, :13], x[:0]):  # strided rows, a short row, no rows
        assert torch.equal(argmax_cpu(rows), rows.float().argmax(dim=-1))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march names")
def test_portable_build_without_avx512(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The AVX-512 paths are #ifdef'd; this machine would never run the others otherwise.
    from asyncengine.kernels.fused_cpu import argmax_cpu
    from asyncengine.kernels.paged_attention_cpu import (
        paged_attention_cpu,
        plan_paged_attention_cpu,
        reshape_and_cache_cpu,
        to_cpu_layout,
    )
    from asyncengine.testing.paged_batches import dense_attention, make_paged_batch

    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64")
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None
        x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        x[2, 1001] = float("nan")
        assert torch.equal(argmax_cpu(x), x.float().argmax(dim=-1))
        b = make_paged_batch([1, 1, 4], [40, 17, 30], 6, 2, 64, 16, torch.bfloat16, seed=5)
        cache = to_cpu_layout(b.base_cache)
        reshape_and_cache_cpu(b.key, b.value, cache, b.slot_mapping)
        plan = plan_paged_attention_cpu(
            b.query_start_loc, b.seq_lens, b.block_table, 16, b.query.dtype
        )
        out = paged_attention_cpu(b.query, b.key, b.value, cache, plan, 0.125)
        assert float((out.float() - dense_attention(b, 0.125)).abs().max()) <= 1.6e-2
    finally:
        cpu_native.load_native.cache_clear()


INLINE_HELPERS = ("load16_as_f32", "load16", "load_f32", "store_f32", "exp2_normal", "round_row")


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils)")
def test_inner_loop_helpers_are_inlined() -> None:
    # GCC once stopped inlining these as the file grew, which made the attention ~2x slower:
    # a call per 16 values. They are forced inline now; no symbol of theirs may be left.
    lib = cpu_native.require_native()
    listing = subprocess.run(["nm", str(lib.path)], capture_output=True, text=True, check=True)
    names = {line.split()[-1].split(".")[0] for line in listing.stdout.splitlines() if line}
    assert not names & set(INLINE_HELPERS)
