"""The K-quant linear kernels (Q4_K, Q5_K, Q6_K: kernels/csrc/quant_kquants.c, reached through
quant_cpu.linear_quant_cpu): products on awkward shapes on every CPU path this build has, for
fp32, bf16 and fp16 activations, with bias, on blocks of extreme scales, against the exact
product of the same quantized activations and the dequantized weight (quant_formats.dequantize,
equal to gguf-py's)."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import cpu_native, quant_cpu
from asyncengine.kernels.cpu_native import DTYPE_CODES, load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    Q4_K,
    Q5_K,
    Q6_K,
    QK,
    QKK,
    dequantize,
    linear_quant_cpu,
    linear_quant_torch,
    quantize_rows_q8_torch,
)
from asyncengine.kernels.quant_formats import FORMATS, random_blocks

pytestmark = pytest.mark.timeout(300)
native = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
PATHS_HERE = quant_cpu.available_paths() if load_native() is not None else ()
KQ = [Q4_K, Q5_K, Q6_K]


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    if load_native() is not None:
        quant_cpu.set_path(None)


def _offsets(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """|the constant part| of each weight [N, K] that the kernels subtract apart from the
    products of q: Q4_K / Q5_K's dmin * m, Q6_K's 32 * d * sc."""
    n = qweight.shape[0]
    b = qweight.reshape(n, -1, FORMATS[qtype].nbytes)
    if qtype == Q6_K:
        sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [N, blocks, 16]
        d = b[..., 208:210].contiguous().view(torch.float16).float()
        return (32 * d * sc).abs().repeat_interleave(16, dim=-1).reshape(n, -1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()  # [N, blocks, 1]
    s = b[..., 4:16].to(torch.int32)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return (dmin * m.float()).abs().repeat_interleave(32, dim=-1).reshape(n, -1)


def _exact(x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None):
    """The kernel's product in float64 (activations quantized as it does), and the sum of the
    magnitudes of the terms it adds (each weight's q part and its constant part apart)."""
    qs, d = quantize_rows_q8_torch(x.float(), QKK)  # one scale per super-block
    xq = (qs.double().reshape(len(x), -1, QK) * d.double().unsqueeze(-1)).reshape(x.shape)
    w = dequantize(qweight, qtype).double()
    out = xq @ w.T
    if bias is not None:
        out += bias.double()
    off = _offsets(qweight, qtype).double()
    return out, xq.abs() @ (w.abs() + 2 * off).T


def _check(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: str,
           bias: torch.Tensor | None) -> None:  # fmt: skip
    exact, magnitude = _exact(x, qweight, qtype, bias)
    # what is left is the order of the fp32 sums, and the one rounding to a 16-bit dtype
    rounding = torch.finfo(out.dtype).eps * exact.abs() if out.dtype != torch.float32 else 0.0
    err = (out.double() - exact).abs()
    assert torch.all(err <= 2.0**-16 * magnitude + rounding), (err - rounding).max()


# (M, N, K): N no multiple of the tiles (4, 2) or of the items (16); M through the row tiles'
# remainders, on the pool (<= 8 rows) and on OpenMP; K one super-block, three, and eleven.
SHAPES = [
    (1, 1, 256),
    (1, 37, 768),
    (1, 300, 256),
    (2, 7, 2816),
    (3, 37, 256),
    (5, 7, 768),
    (17, 37, 256),
    (64, 7, 768),
]


@native
def test_the_build_runs_the_k_quants() -> None:
    assert set(KQ) <= set(quant_cpu.native_formats())


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_products_match_the_exact_reference(
    shape: tuple[int, int, int], dtype: torch.dtype, qtype: str, path: str
) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * n + k + FORMATS[qtype].code)
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight = random_blocks(qtype, n, k, gen)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if m % 2 else None
    assert quant_cpu.set_path(path) == path
    out = linear_quant_cpu(x, qweight, qtype, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(out, x, qweight, qtype, bias)
    # the torch backend's numbers are the kernel's up to the order of the sums
    fallback = linear_quant_torch(x, qweight, qtype, bias)
    exact, magnitude = _exact(x, qweight, qtype, bias)
    rounding = torch.finfo(dtype).eps * exact.abs() * 2 if dtype != torch.float32 else 0.0
    assert torch.all((fallback.double() - exact).abs() <= 2.0**-16 * magnitude + rounding)


def _extreme_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks with, row by row: zero scales everywhere (d, dmin and the scale bytes),
    scale / min bytes all 0 or all 63 (Q6_K: -128, 127), every q at its largest or 0, and a
    mix in the remaining rows."""
    q = random_blocks(qtype, n, k, gen)
    b = q.view(n, -1, FORMATS[qtype].nbytes)  # a view: writes change q
    if qtype == Q6_K:
        b[0, :, 192:] = 0  # scales and d zero
        b[1, :, 192:208] = 0x80  # scales -128
        b[2, :, 192:208] = 0x7F  # scales 127
        b[3, :, :192] = 0xFF  # every q 63
        b[4, :, :192] = 0  # every q 0: w = -32 * d * sc
        b[5, ::2, 192:208] = 0  # every other super-block's scales 0
    else:
        b[0, :, :16] = 0  # d, dmin, scales and mins zero
        b[1, :, 4:16] = 0  # scales and mins 0
        b[2, :, 4:16] = 0xFF  # scales and mins 63
        b[3, :, 16:] = 0xFF  # every q at its largest (and Q5_K's fifth bits set)
        b[4, :, 16:] = 0  # every q 0: w = -dmin * m
        b[5, :, 2:4] = 0  # dmin 0
        b[6, :, 4:16] = torch.tensor([0x3F] * 4 + [0] * 4 + [0x0F] * 4, dtype=torch.uint8)
    return q


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_extreme_and_zero_scales(m: int, qtype: str, path: str) -> None:
    gen = torch.Generator().manual_seed(7 + m)
    k = 768
    qweight = _extreme_blocks(qtype, 11, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :QK] = 0  # a zero activation block
    x[-1, 40] = 500.0  # an outlier that flattens its block
    quant_cpu.set_path(path)
    out = linear_quant_cpu(x, qweight, qtype)
    _check(out, x, qweight, qtype, None)
    assert torch.all(out[:, 0] == 0)  # zero scales: exactly zero


@native
@pytest.mark.parametrize("qtype", KQ)
def test_paths_agree_on_a_decode_sized_layer(qtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 4096, generator=gen)
    x = wide[:, :2048]  # strided rows: a view of every other half of a wider batch
    qweight = random_blocks(qtype, 130, 2048, gen)
    for rows in (x[:1], x):
        for path in PATHS_HERE:
            quant_cpu.set_path(path)
            _check(linear_quant_cpu(rows, qweight, qtype), rows, qweight, qtype, None)


@native
@pytest.mark.parametrize("qtype", KQ)
def test_a_bad_k_is_refused(qtype: str) -> None:
    gen = torch.Generator().manual_seed(4)
    qweight = random_blocks(qtype, 4, 512, gen)
    with pytest.raises(ValueError, match="multiple of 256"):
        linear_quant_cpu(torch.randn(1, 288), qweight, qtype)
    # the native entry itself: K a multiple of 32 but not of 256, or not positive
    lib = quant_cpu._kernels()
    x, out = torch.randn(1, 288), torch.empty(1, 4)
    code, f32 = FORMATS[qtype].code, DTYPE_CODES[torch.float32]
    for k in (288, 0, -256):
        status = lib.linear_quant(
            code, f32, x.data_ptr(), 288, 1, qweight.data_ptr(), 4, k, None, out.data_ptr(), 4,
            1,
        )  # fmt: skip
        assert status == -2


@native
def test_portable_build_computes_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A build for an AVX2-only CPU (x86-64-v3) has the AVX2 and scalar paths only.
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 -march names")
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64-v3")
    cpu_native.load_native.cache_clear()
    quant_cpu._kernels.cache_clear()
    try:
        assert quant_cpu.available_paths() == ("scalar", "avx2")
        assert set(KQ) <= set(quant_cpu.native_formats())
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(13, 768, generator=gen)  # 13 rows: the AVX2 panel GEMM for each
        for qtype in KQ:
            qweight = random_blocks(qtype, 21, 768, gen)
            for path in ("scalar", "avx2"):
                quant_cpu.set_path(path)
                for rows in (x[:1], x[:3], x):
                    _check(linear_quant_cpu(rows, qweight, qtype), rows, qweight, qtype, None)
    finally:
        cpu_native.load_native.cache_clear()
        quant_cpu._kernels.cache_clear()
