"""Q5_0_BYTES, the AVX2 machines' layout of Q5_0 weights (Q8_0's block: d and the 32 values
q - 16 as int8; made at load by `q5_0_to_bytes`): it holds the same weights, and every product
over it (the tiles of every path, the panel GEMM, dequantization, an embedding's rows) gives
the numbers of the same product over the file's Q5_0 rows: the integer block dots are
the same, only the order of the fp32 sums differs (the tiles' shapes are Q8_0's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels import quant_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    Q5_0,
    Q5_0_BYTES,
    decode_layout,
    dequantize_cpu,
    linear_quant_cpu,
    quantize_weight,
)
from asyncengine.kernels.quant_formats import dequantize, q5_0_to_bytes, random_blocks

pytestmark = pytest.mark.timeout(300)
native = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
PATHS_HERE = quant_cpu.available_paths() if load_native() is not None else ()
SHAPES = [(1, 32), (24, 768), (136, 2304), (64, 2048)]  # N x K


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    if load_native() is not None:
        quant_cpu.set_path(None)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_bytes_hold_the_same_weights(shape: tuple[int, int]) -> None:
    n, k = shape
    rows = random_blocks(Q5_0, n, k, torch.Generator().manual_seed(n + k))
    got = q5_0_to_bytes(rows)
    assert got.dtype == torch.uint8 and got.shape == (n, k // 32 * 34)
    assert torch.equal(dequantize(got, Q5_0_BYTES), dequantize(rows, Q5_0))
    values = got.reshape(n, -1, 34)[..., 2:].contiguous().view(torch.int8)
    assert values.min() >= -16 and values.max() <= 15
    assert torch.equal(got.reshape(n, -1, 34)[..., :2], rows.reshape(n, -1, 22)[..., :2])


def test_only_q5_0_rows_are_taken() -> None:
    with pytest.raises(ValueError, match="q5_0 weight is uint8"):
        q5_0_to_bytes(torch.zeros(4, 34, dtype=torch.uint8))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantized_values_are_the_files(dtype: torch.dtype) -> None:
    rows = quantize_weight(torch.randn(40, 512, generator=torch.Generator().manual_seed(2)), Q5_0)
    got = dequantize_cpu(q5_0_to_bytes(rows), Q5_0_BYTES, dtype)
    assert torch.equal(got, dequantize_cpu(rows, Q5_0, dtype))


@native
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_products_equal_the_files_products(
    shape: tuple[int, int], dtype: torch.dtype, path: str
) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(3 * n + k)
    rows = quantize_weight(torch.randn(n, k, generator=gen) * 0.02, Q5_0)
    as_bytes = q5_0_to_bytes(rows)
    quant_cpu.set_path(path)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):  # the tiles of 1-4 rows, several tiles, the GEMM
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        x[0, :32] = 0  # a zero activation block
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if m % 2 else None
        want = linear_quant_cpu(x, rows, Q5_0, bias).double()
        got = linear_quant_cpu(x, as_bytes, Q5_0_BYTES, bias).double()
        # fp32 sums in another order, then one rounding to dtype (either way for a tie)
        tol = 1e-5 * want.abs().max() + torch.finfo(dtype).eps * want.abs()
        assert torch.all((got - want).abs() <= tol), (m, path, (got - want).abs().max())


@native
def test_the_decode_layout_is_bytes_on_the_avx2_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = random_blocks(Q5_0, 16, 256, torch.Generator().manual_seed(6))
    for path in PATHS_HERE:
        quant_cpu.set_path(path)
        weight, layout = decode_layout(rows, Q5_0)
        if path == "avx2":
            assert layout == Q5_0_BYTES and torch.equal(weight, q5_0_to_bytes(rows))
        else:
            assert layout != Q5_0_BYTES
    if "avx2" in PATHS_HERE:
        quant_cpu.set_path("avx2")
    monkeypatch.setattr(quant_cpu, "Q5_0_AS_BYTES", False)
    assert decode_layout(rows, Q5_0)[1] != Q5_0_BYTES


@native
def test_an_embedding_reads_its_rows_from_the_bytes() -> None:
    from asyncengine.model.quant_linear import QuantEmbedding

    rows = quantize_weight(torch.randn(48, 256, generator=torch.Generator().manual_seed(7)), Q5_0)
    ids = torch.tensor([5, 47, 0, 5, 8, 15, 16, 33])
    want = QuantEmbedding(rows, Q5_0, torch.bfloat16)(ids)
    assert torch.equal(QuantEmbedding(q5_0_to_bytes(rows), Q5_0_BYTES, torch.bfloat16)(ids), want)
