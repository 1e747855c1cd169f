"""The many-row product over GGUF blocks on AVX512-VNNI (csrc/quant_gemm.c) and on AVX2
(csrc/quant_gemm_avx2.c, and csrc/quant_gemm_f32.c for Q8_0 from 16 rows): every format each
path runs, on awkward shapes (rows through the tiles' remainders, weight rows past the 32-row
panels and their 16-row halves, one and several blocks), each dtype, with and without a bias,
against the product of the same int8 activations (AVX2's Q8_0 from 16 rows where the fp32
product is on: the activations as they are) and the dequantized weight in float64; and which
products take it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import quant_cpu
from asyncengine.kernels.cpu_native import DTYPE_CODES, load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    QK,
    activation_group,
    dequantize,
    gemm_f32_min_rows,
    linear_quant_cpu,
    quant_gemm_cpu,
    quantize_rows_q8_torch,
)
from asyncengine.kernels.quant_formats import FORMATS, quant_format, random_blocks
from asyncengine.model.quant_linear import QuantLinear

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
]


def _path_here(path: str) -> bool:
    return load_native() is not None and path in quant_cpu.available_paths()


vnni = pytest.mark.skipif(not _path_here("avx512_vnni"), reason="this CPU has no AVX512-VNNI")
avx2 = pytest.mark.skipif(not _path_here("avx2"), reason="this CPU has no AVX2")
GEMM_PATHS = [pytest.param("avx512_vnni", marks=vnni), pytest.param("avx2", marks=avx2)]


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    quant_cpu.set_path(None)
    quant_cpu.set_gemm_f32(None)


def _exact(
    x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of x's int8 blocks (x itself where the path multiplies this many rows in
    fp32) and the dequantized weight in float64, and the sum of the products' and the bias's
    magnitudes (what the fp32 sums' rounding scales with)."""
    f32_rows = gemm_f32_min_rows(qtype)
    if f32_rows and x.shape[0] >= f32_rows:
        xq = x.double()
    else:
        qs, d = quantize_rows_q8_torch(x.float(), activation_group(qtype))
        xq = (qs.double().unflatten(1, (-1, QK)) * d.double()[..., None]).flatten(1)
    w = dequantize(qweight, qtype).double()
    out, magnitude = xq @ w.T, xq.abs() @ w.abs().T
    if bias is not None:
        out += bias.double()
        magnitude += bias.double().abs()
    return out, magnitude


@pytest.mark.parametrize("path", GEMM_PATHS)
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_match_the_exact_product(path: str, qtype: str, dtype: torch.dtype) -> None:
    quant_cpu.set_path(path)
    values = quant_format(qtype).values
    generator = torch.Generator().manual_seed(len(qtype) * 7 + DTYPE_CODES[dtype])
    if path == "avx2" and quant_format(qtype).row_group > 1:  # the 8-row layouts: VNNI only
        with pytest.raises(ValueError, match="no panel GEMM for"):
            quant_gemm_cpu(torch.ones(2, values), random_blocks(qtype, 8, values, generator), qtype)
        return
    shapes = [(1, 33, 1), (3, 1, 2), (4, 64, 3), (6, 70, 1), (9, 31, 4), (13, 97, 2), (5, 16, 5)]
    shapes += [(16, 35, 1), (23, 70, 2), (37, 5, 3)]  # AVX2's Q8_0 in fp32 (blocks of 16 rows)
    for m, n, blocks in shapes:
        k = blocks * max(values, 64)
        group = quant_format(qtype).row_group
        n = -(-n // group) * group  # Q4_K_R8: whole groups of 8 rows
        qweight = random_blocks(qtype, n, k, generator)
        x = torch.randn(m, k, generator=generator).to(dtype)
        x[0, : k // 2] = 0  # zero activation blocks: scale 0
        bias = (torch.randn(n, generator=generator) * 3).to(dtype) if m % 2 else None
        out = quant_gemm_cpu(x, qweight, qtype, bias)
        exact, magnitude = _exact(x, qweight, qtype, bias)
        rounding = torch.finfo(dtype).eps * exact.abs() if dtype != torch.float32 else 0.0
        err = (out.double() - exact).abs()
        assert torch.all(err <= 2.0**-16 * magnitude + rounding), (m, n, k, err.max())


# The VNNI path's thresholds: one row stays a matrix-vector product; the file layouts of the
# K-quants unpack slower, and their 8-row tiles measured faster than the GEMM up to 8 rows.
_VNNI_GEMM_ROWS = {"q4_k": 9, "q8_0_r8": 6, "q4_k_r8": 9, "q6_k_r8": 9}


@vnni
@pytest.mark.parametrize("qtype", sorted(_VNNI_GEMM_ROWS))
def test_many_rows_take_the_gemm_and_fewer_the_tiles(qtype: str) -> None:
    """linear_quant_cpu runs the panel GEMM from gemm_min_rows(qtype) rows on the VNNI path
    (the same numbers, up to the order of the fp32 sums), never on another path."""
    rows = quant_cpu.gemm_min_rows(qtype)
    assert rows == _VNNI_GEMM_ROWS[qtype]
    _check_rows_around(qtype, rows, 40, seed=3)
    quant_cpu.set_path("avx2")  # its GEMM reads the file layouts only
    assert quant_cpu.gemm_min_rows(qtype) == (7 if qtype == "q4_k" else 0)  # no 8-row layouts
    quant_cpu.set_path("scalar")
    assert quant_cpu.gemm_min_rows(qtype) == 0


@avx2
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q6_k"])
def test_avx2_takes_its_gemm_from_its_rows(qtype: str) -> None:
    """On the AVX2 path linear_quant_cpu runs quant_gemm_avx2.c's panels from gemm_min_rows
    rows (the same numbers as quant_gemm_cpu there), the tiles below."""
    quant_cpu.set_path("avx2")
    rows = quant_cpu.gemm_min_rows(qtype)
    assert rows == {"q8_0": 10, "q4_0": 4, "q6_k": 8}[qtype]
    _check_rows_around(qtype, rows, 48, seed=4)


def _check_rows_around(qtype: str, rows: int, n: int, seed: int) -> None:
    """linear_quant_cpu at rows - 1, rows and more rows matches the exact product, and from
    `rows` on equals quant_gemm_cpu (the panel GEMM of the path in effect). (AVX2's Q8_0: 10
    and 21 rows, the second on quant_gemm_f32.c.)"""
    generator = torch.Generator().manual_seed(seed)
    qweight = random_blocks(qtype, n, 512, generator)
    for m in (rows - 1, rows, 2 * rows + 1):
        x = torch.randn(m, 512, generator=generator)
        exact, magnitude = _exact(x, qweight, qtype, None)
        out = linear_quant_cpu(x, qweight, qtype)
        assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude)
        if m >= rows:
            assert torch.equal(out, quant_gemm_cpu(x, qweight, qtype))


@avx2
def test_quant_linear_keeps_many_rows_on_the_int8_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a panel GEMM (AVX512-VNNI, AVX2), many-row products never dequantize the weight;
    on the scalar path, which has none, they do from dequant_min_rows rows."""
    generator = torch.Generator().manual_seed(5)
    layer = QuantLinear(random_blocks("q8_0", 48, 256, generator), "q8_0", None)
    calls: list[int] = []
    product = QuantLinear._dequantized_product

    def spy(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return product(self, x)

    monkeypatch.setattr(QuantLinear, "_dequantized_product", spy)
    x = torch.randn(64, 256, generator=generator).to(torch.bfloat16)
    layer(x)
    assert calls == []
    quant_cpu.set_path("avx2")
    layer(x)
    assert calls == []
    quant_cpu.set_path("scalar")
    layer(x)
    assert calls == [64]


def _half_width_vectors() -> bool:
    """Whether /proc/cpuinfo names an AMD family 17h core before model 30h (Zen 1, Zen+)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in info.splitlines()[:30])
    )
    return (
        fields.get("vendor_id") == "AuthenticAMD"
        and fields.get("cpu family") == "23"
        and int(fields.get("model", "0")) < 0x30
    )


@avx2
def test_avx2_q8_0_takes_fp32_from_16_rows_where_turned_on() -> None:
    """With set_gemm_f32 on (the default on Zen 1 / Zen+ only), AVX2's Q8_0 products of 16 rows
    and more multiply the dequantized weight by x as it is, in fp32 (csrc/quant_gemm_f32.c):
    15 rows match the int8 activations' product, 16 and 50 rows the unquantized one, up to
    fp32 rounding. No other format or path does, nor Q8_0 with it off."""
    quant_cpu.set_path("avx2")
    assert quant_cpu.set_gemm_f32(None) == _half_width_vectors()
    assert quant_cpu.set_gemm_f32(False) is False
    assert gemm_f32_min_rows("q8_0") == 0
    assert quant_cpu.set_gemm_f32(True) is True
    assert gemm_f32_min_rows("q8_0") == 16
    assert all(gemm_f32_min_rows(q) == 0 for q in FORMATS if q != "q8_0")
    generator = torch.Generator().manual_seed(6)
    qweight = random_blocks("q8_0", 70, 1024, generator)  # 3 panels, the last of 6 rows
    w = dequantize(qweight, "q8_0").double()
    for m in (15, 16, 50):
        wide = torch.randn(m, 1056, generator=generator).to(torch.bfloat16)
        x = wide[:, 32:] if m == 50 else wide[:, :1024]  # 50: rows with their own stride
        qs, d = quantize_rows_q8_torch(x.float(), QK)
        xq = (qs.double().unflatten(1, (-1, QK)) * d.double()[..., None]).flatten(1)
        exact = (x.double() if m >= 16 else xq) @ w.T
        magnitude = (x.double() if m >= 16 else xq).abs() @ w.abs().T
        out = linear_quant_cpu(x, qweight, "q8_0").double()
        assert torch.equal(out, quant_gemm_cpu(x, qweight, "q8_0").double()) or m < 16
        rounding = torch.finfo(torch.bfloat16).eps * exact.abs()
        assert torch.all((out - exact).abs() <= 2.0**-16 * magnitude + rounding), m
        # the int8 activations' product is off by more than that (the test tells them apart)
        other = (xq if m >= 16 else x.double()) @ w.T
        assert (other - exact).abs().max() > 10 * (2.0**-16 * magnitude).max()
    # awkward shapes (row blocks of 16 and chunks of 256 values with remainders), each dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for m, n, k in [(16, 35, 32), (23, 70, 96), (37, 5, 288), (40, 33, 1056)]:
            qweight = random_blocks("q8_0", n, k, generator)
            x = torch.randn(m, k, generator=generator).to(dtype)
            bias = (torch.randn(n, generator=generator) * 3).to(dtype) if m % 2 else None
            exact, magnitude = _exact(x, qweight, "q8_0", bias)
            out = quant_gemm_cpu(x, qweight, "q8_0", bias)
            rounding = torch.finfo(dtype).eps * exact.abs() if dtype != torch.float32 else 0.0
            assert torch.all((out.double() - exact).abs() <= 2.0**-16 * magnitude + rounding)
    quant_cpu.set_gemm_f32(False)
    assert gemm_f32_min_rows("q8_0") == 0
    for path in ("scalar", *(p for p in ("avx512_vnni",) if _path_here(p))):
        quant_cpu.set_path(path)
        assert quant_cpu.set_gemm_f32(True) and gemm_f32_min_rows("q8_0") == 0
