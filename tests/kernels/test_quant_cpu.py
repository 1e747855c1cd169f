"""The legacy formats' linear kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; kernels/quant_cpu.py,
csrc/quant_legacy.c): ggml's block formats bit for bit, the activation quantization, and
products on awkward shapes on every CPU path this build has, against the dequantize-then-fp32
reference."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asyncengine.kernels import cpu_native, quant_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    LEGACY,
    Q4_0,
    Q4_K,
    Q8_0,
    QK,
    QKK,
    activation_group,
    dequantize,
    dequantize_rows_q8,
    linear_quant_cpu,
    linear_quant_torch,
    quantize_rows_q8_cpu,
    quantize_rows_q8_torch,
    quantize_weight,
)
from asyncengine.kernels.quant_formats import random_blocks

pytestmark = pytest.mark.timeout(120)
native = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
# Every path this build has (on an AVX2-only machine, no VNNI; in the portable build, scalar).
PATHS_HERE = quant_cpu.available_paths() if load_native() is not None else ()


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    if load_native() is not None:
        quant_cpu.set_path(None)


@pytest.mark.parametrize("qtype", LEGACY)
def test_weight_blocks_are_ggufs_bytes(qtype: str) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    import gguf

    torch.manual_seed(0)
    w = torch.randn(9, 256) * 0.3
    w[0, :32] = 0  # a zero block: scale 0
    w[1, 5] = -3.0  # a block whose largest magnitude is negative
    w[2, 40] = 3.0
    w[3, 64:96] = 0.7  # one value: Q4_1 / Q5_1 scale 0 with a minimum
    w[4, 96:128] = torch.linspace(-1, 1, 32)  # values on the steps (ties in the rounding)
    kind = gguf.GGMLQuantizationType[qtype.upper()]
    theirs = torch.from_numpy(gguf_quants.quantize(w.numpy(), kind))
    assert torch.equal(quantize_weight(w, qtype), theirs)
    ref = torch.from_numpy(gguf_quants.dequantize(theirs.numpy(), kind))
    assert torch.equal(dequantize(theirs, qtype), ref.float())


def test_q4_0_low_nibbles_are_the_first_half_of_a_block() -> None:
    block = torch.zeros(1, 18, dtype=torch.uint8)
    block[0, :2] = torch.tensor([2.0], dtype=torch.float16).view(torch.uint8)
    low = torch.arange(16, dtype=torch.uint8)
    block[0, 2:] = low | (15 - low) << 4
    w = dequantize(block, Q4_0)[0]
    assert torch.equal(w[:16], (torch.arange(16) - 8).float() * 2)
    assert torch.equal(w[16:], (7 - torch.arange(16)).float() * 2)


@native
@pytest.mark.parametrize("group", [QK, QKK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_activation_quantization_is_the_torch_one(dtype: torch.dtype, group: int) -> None:
    torch.manual_seed(1)
    x = (torch.randn(5, 768) * torch.rand(5, 768) * 4).to(dtype)
    x[1, 256:512] = 0  # a zero block (and super-block)
    x[2, 7] = 1e4  # an outlier that flattens its block (super-block)
    qs, d = quantize_rows_q8_cpu(x, group)
    ref_qs, ref_d = quantize_rows_q8_torch(x, group)
    assert torch.equal(qs, ref_qs) and torch.equal(d, ref_d)
    assert d.shape == (5, 768 // QK) and int(qs.abs().max()) == 127
    assert torch.all(d[1, 8:16] == 0)
    # one scale per group, the same in each of its blocks of 32
    assert torch.equal(d, d[:, :: group // QK].repeat_interleave(group // QK, dim=1))
    assert torch.all(qs[2, 8:group].abs() <= 1)  # the outlier flattened the whole group
    # each value within half a step of its group's scale
    err = (dequantize_rows_q8(qs, d) - x.float()).abs()
    assert torch.all(err <= d.repeat_interleave(QK, dim=1) * 0.5001)


@native
def test_activation_groups_are_checked() -> None:
    with pytest.raises(ValueError, match="32 or 256"):
        quantize_rows_q8_cpu(torch.randn(1, 256), 64)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        quantize_rows_q8_cpu(torch.randn(1, 288), QKK)
    assert activation_group(Q8_0) == QK and activation_group(Q4_K) == QKK


def _exact(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: str,
    bias: torch.Tensor | None,
    quantized: bool | None = None,
):
    """The kernel's product in float64 (activations quantized as it does: to int8 blocks, or
    not at all where the path in effect multiplies this many rows in fp32), and the sum of its
    terms' magnitudes. `quantized` says which instead."""
    if quantized is None:
        f32_rows = quant_cpu.gemm_f32_min_rows(qtype) if load_native() is not None else 0
        quantized = not f32_rows or len(x) < f32_rows
    qs, d = quantize_rows_q8_torch(x.float())
    xq = (qs.double().reshape(len(x), -1, QK) * d.double().unsqueeze(-1)).reshape(x.shape)
    if not quantized:
        xq = x.double()
    w = dequantize(qweight, qtype).double()
    out = xq @ w.T
    if bias is not None:
        out += bias.double()
    return out, xq.abs() @ w.abs().T


# (M, N, K): K a multiple of 32 but not of 256 (one block: 32); N no multiple of the tiles (4,
# 2) or of the items (16); M across the pool (<= 8 rows) and OpenMP, and through the row tiles'
# remainders (5, 17). The VNNI path takes blocks 16 at a time, in pairs: 16 blocks (512) with no
# remainder, 33 (1056) and 47 (1504) with an odd one, 1 and 3 (32, 96) with no full group.
SHAPES = [
    (1, 37, 96),
    (1, 300, 256),
    (1, 20, 512),
    (2, 64, 1056),
    (3, 41, 1504),
    (5, 23, 32),
    (7, 33, 160),
    (17, 13, 1056),
    (64, 19, 288),
]


def _inputs(
    shape: tuple[int, int, int], dtype: torch.dtype, qtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x, the quantized weight and a bias (odd M only) for a product test, with zero blocks
    in both (scale 0: for Q4_1 / Q5_1 also m 0) and a constant weight block (scale 0, m not)."""
    m, n, k = shape
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k)
    x[0, k - 32 :] = 0
    w = torch.randn(n, k) * 0.05
    w[0, :32] = 0
    w[n - 1, k - 32 :] = 0.03
    bias = (torch.randn(n) * 0.1).to(dtype) if m % 2 else None
    return x.to(dtype), quantize_weight(w, qtype), bias


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("qtype", LEGACY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_products_match_the_dequantized_reference(
    shape: tuple[int, int, int], dtype: torch.dtype, qtype: str, path: str
) -> None:
    m, n, _ = shape
    x, qweight, bias = _inputs(shape, dtype, qtype)
    assert quant_cpu.set_path(path) == path
    out = linear_quant_cpu(x, qweight, qtype, bias)
    assert out.dtype == dtype and out.shape == (m, n)

    # Tight: the same activation quantization, exact in float64; what is left is the order of
    # the fp32 sums (and the one rounding to bf16).
    exact, magnitude = _exact(x, qweight, qtype, bias)
    rounding = torch.finfo(dtype).eps * exact.abs() if dtype == torch.bfloat16 else 0.0
    err = (out.double() - exact).abs()
    assert torch.all(err <= 2.0**-16 * magnitude + rounding), err.max()

    # Loose: against the plain fp32 product over the dequantized weight, the activations'
    # rounding (half a step of each block's scale per value) bounds the difference.
    plain = F.linear(x.float(), dequantize(qweight, qtype), None if bias is None else bias.float())
    _, d = quantize_rows_q8_torch(x.float())
    step = d.repeat_interleave(QK, dim=1) * 0.5
    bound = step @ dequantize(qweight, qtype).abs().T
    loose_rounding = torch.finfo(dtype).eps * plain.abs() + 2.0**-16 * magnitude.float()
    assert torch.all((out.float() - plain).abs() <= bound * 1.001 + loose_rounding)

    # The torch backend's numbers are the int8 kernels' up to the order of the sums.
    fallback = linear_quant_torch(x, qweight, qtype, bias)
    exact, magnitude = _exact(x, qweight, qtype, bias, quantized=True)
    assert torch.all((fallback.double() - exact).abs() <= 2.0**-16 * magnitude + rounding * 2)


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("qtype", LEGACY)
@pytest.mark.parametrize("shape", [(1, 37, 96), (5, 23, 32), (17, 13, 1056)], ids=str)
def test_fp16_products(shape: tuple[int, int, int], qtype: str, path: str) -> None:
    x, qweight, bias = _inputs(shape, torch.float16, qtype)
    quant_cpu.set_path(path)
    out = linear_quant_cpu(x, qweight, qtype, bias)
    assert out.dtype == torch.float16 and out.shape == (shape[0], shape[1])
    exact, magnitude = _exact(x, qweight, qtype, bias)
    rounding = torch.finfo(torch.float16).eps * exact.abs()
    assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude + rounding)


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("qtype", LEGACY)
def test_random_blocks_give_the_torch_references_numbers(qtype: str, path: str) -> None:
    # Blocks of random bytes (every nibble and fifth bit pattern, large minimums against small
    # scales), not what a quantizer writes: the kernel and linear_quant_torch still agree up to
    # the order of the fp32 sums.
    generator = torch.Generator().manual_seed(7)
    quant_cpu.set_path(path)
    for m, n, k in [(1, 45, 1056), (6, 21, 480)]:
        qweight = random_blocks(qtype, n, k, generator)
        x = torch.randn(m, k, generator=generator)
        out = linear_quant_cpu(x, qweight, qtype)
        ref = linear_quant_torch(x, qweight, qtype)
        exact, magnitude = _exact(x, qweight, qtype, None)
        assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude)
        assert torch.all((out.double() - ref.double()).abs() <= 2.0**-15 * magnitude)


@native
def test_the_legacy_formats_run_natively() -> None:
    assert set(LEGACY) <= set(quant_cpu.native_formats())


@native
@pytest.mark.parametrize("qtype", LEGACY)
def test_paths_agree_on_a_decode_sized_layer(qtype: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(3, 1024)  # strided rows: a view of every other row of a wider batch
    wide = torch.randn(3, 2048)
    wide[:, :1024] = x
    qweight = quantize_weight(torch.randn(130, 1024) * 0.02, qtype)
    outs = []
    for path in PATHS_HERE:
        quant_cpu.set_path(path)
        outs.append(linear_quant_cpu(wide[:, :1024], qweight, qtype))
    exact, magnitude = _exact(x, qweight, qtype, None)
    for out in outs:
        assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude)


@native
def test_bad_shapes_and_paths_are_refused() -> None:
    qweight = quantize_weight(torch.randn(4, 64), Q8_0)
    with pytest.raises(ValueError, match="multiple of 32"):
        linear_quant_cpu(torch.randn(1, 48), quantize_weight(torch.randn(4, 64), Q8_0), Q8_0)
    with pytest.raises(ValueError, match="uint8"):
        linear_quant_cpu(torch.randn(1, 64), qweight, Q4_0)  # Q8_0 bytes read as Q4_0
    with pytest.raises(ValueError, match="unsupported"):
        linear_quant_cpu(torch.randn(1, 64), qweight, "iq4_xs")
    with pytest.raises(ValueError, match="unknown"):
        quant_cpu.set_path("amx")


@native
def test_the_environment_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert quant_cpu.current_path() == PATHS_HERE[-1]  # the best, unless told
    monkeypatch.setenv(quant_cpu.PATH_ENV, "scalar")
    quant_cpu._kernels.cache_clear()  # the variable is read when the kernels are first used
    try:
        assert quant_cpu.current_path() == "scalar"
    finally:
        monkeypatch.delenv(quant_cpu.PATH_ENV)
        quant_cpu._kernels.cache_clear()


@native
def test_portable_build_computes_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The SIMD paths are #ifdef'd: a build for an AVX2-only CPU (x86-64-v3: AVX2 and FMA, no
    # AVX-512) has the AVX2 and scalar paths only, and must give the same numbers. (A build
    # without AVX2 compiles the scalar path alone, which the native build runs too.)
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 -march names")
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64-v3")
    cpu_native.load_native.cache_clear()
    quant_cpu._kernels.cache_clear()
    try:
        assert quant_cpu.available_paths() == ("scalar", "avx2")
        assert quant_cpu.current_path() == "avx2"
        torch.manual_seed(5)
        for rows in (3, 13):  # 13: the AVX2 panel GEMM (quant_gemm_avx2.c) for every format
            x = torch.randn(rows, 160)
            for qtype in LEGACY:
                qweight = quantize_weight(torch.randn(21, 160) * 0.05, qtype)
                exact, magnitude = _exact(x, qweight, qtype, None)
                for path in ("scalar", "avx2"):
                    quant_cpu.set_path(path)
                    assert (quant_cpu.gemm_min_rows(qtype) > 0) == (path == "avx2")
                    out = linear_quant_cpu(x, qweight, qtype)
                    assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude)
    finally:
        cpu_native.load_native.cache_clear()
        quant_cpu._kernels.cache_clear()
