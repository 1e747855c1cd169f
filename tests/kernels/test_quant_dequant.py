"""`dequantize_cpu` (csrc/quant_dequant.c): every format read back as fp32, bf16 and fp16 equals
`quant_formats.dequantize` (gguf-py's numbers) rounded once, bit for bit; and `QuantLinear`'s
many-row products on CPUs without AVX512-VNNI, which run the float GEMM on it, equal that
product over the dequantized weight (the AVX2 path stands in for such a CPU here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from asyncengine.kernels import quant_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import dequantize_cpu, linear_quant_cpu
from asyncengine.kernels.quant_formats import FORMATS, dequantize, random_blocks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def no_panel_gemm() -> Iterator[None]:
    """The scalar path, the one without a panel GEMM (csrc/quant_gemm.c, quant_gemm_avx2.c),
    which would take many-row products instead of the dequantized weight."""
    quant_cpu.set_path("scalar")
    yield
    quant_cpu.set_path(None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("n", [1, 7, 33])
def test_every_format_reads_back_as_gguf_py_reads_it(
    qtype: str, dtype: torch.dtype, n: int
) -> None:
    gen = torch.Generator().manual_seed(n)
    k = 2 * FORMATS[qtype].values if FORMATS[qtype].values == 256 else 96
    n = -(-n // FORMATS[qtype].row_group) * FORMATS[qtype].row_group  # Q4_K_R8: groups of 8
    qweight = random_blocks(qtype, n, k, gen)
    assert torch.equal(dequantize_cpu(qweight, qtype, dtype), dequantize(qweight, qtype).to(dtype))


@pytest.mark.parametrize("qtype", ["q8_0", "q5_1", "q6_k"])
def test_out_rows_may_be_strided(qtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    qweight = random_blocks(qtype, 5, 256, gen)
    big = torch.full((5, 300), 7.0, dtype=torch.bfloat16)
    dequantize_cpu(qweight, qtype, torch.bfloat16, out=big[:, :256])
    assert torch.equal(big[:, :256], dequantize(qweight, qtype).bfloat16())
    assert torch.all(big[:, 256:] == 7.0)  # nothing written past the row


def test_bad_weights_and_outputs_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    qweight = random_blocks("q8_0", 4, 64, gen)
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        dequantize_cpu(qweight[:, :-1].contiguous(), "q8_0", torch.float32)
    with pytest.raises(ValueError, match="contiguous uint8"):
        dequantize_cpu(qweight.view(torch.int8), "q8_0", torch.float32)
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[4, 64\]"):
        dequantize_cpu(qweight, "q8_0", torch.float32, out=torch.empty(4, 65))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
@pytest.mark.usefixtures("no_panel_gemm")
def test_many_row_products_run_the_float_gemm_on_the_dequantized_weight(
    qtype: str, dtype: torch.dtype
) -> None:
    from asyncengine.model.quant_linear import DEQUANT_MIN_ROWS, QuantLinear

    gen = torch.Generator().manual_seed(1)
    qweight = random_blocks(qtype, 40, 512, gen)
    bias = torch.randn(40, generator=gen).to(dtype)
    layer = QuantLinear(qweight, qtype, bias)
    x = torch.randn(DEQUANT_MIN_ROWS + 3, 512, generator=gen).to(dtype)
    expected = F.linear(x, dequantize(qweight, qtype).to(dtype), bias)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x[: layer.dequant_min_rows]), expected[: layer.dequant_min_rows])
    # Fewer rows: the int8 kernels (activations rounded to int8 blocks): close, not equal.
    few = x[: layer.dequant_min_rows - 1]
    close = F.linear(few.float(), dequantize(qweight, qtype), bias.float())
    scale = close.abs().max()
    assert (layer(few).float() - close).abs().max() <= 0.05 * scale


@pytest.mark.usefixtures("no_panel_gemm")
def test_a_huge_weight_stays_on_the_int8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncengine.model import quant_linear

    monkeypatch.setattr(quant_linear, "DEQUANT_MAX_VALUES", 40 * 512 - 1)
    gen = torch.Generator().manual_seed(2)
    qweight = random_blocks("q8_0", 40, 512, gen)
    layer = quant_linear.QuantLinear(qweight, "q8_0", None)
    assert not layer.dequant
    x = torch.randn(quant_linear.DEQUANT_MIN_ROWS, 512, generator=gen)
    assert torch.equal(layer(x), linear_quant_cpu(x, qweight, "q8_0"))


@pytest.mark.usefixtures("no_panel_gemm")
def test_a_weight_past_the_chunk_size_dequantizes_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncengine.model import quant_linear

    # chunks of 64 rows (the least), the last one short: 150 = 64 + 64 + 22
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(3)
    qweight = random_blocks("q4_k", 150, 256, gen)
    bias = torch.randn(150, generator=gen).bfloat16()
    layer = quant_linear.QuantLinear(qweight, "q4_k", bias)
    x = torch.randn(2, 20, 256, generator=gen).bfloat16()  # 40 rows: past dequant_min_rows
    expected = F.linear(x, dequantize(qweight, "q4_k").bfloat16(), bias)
    assert torch.equal(layer(x), expected)
