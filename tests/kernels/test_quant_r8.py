"""Q4_K, Q8_0, Q5_0, Q4_0 and Q6_K weights with every 8 rows interleaved (Q4_K_R8, Q8_0_R8,
Q5_0_R8, Q4_0_R8, Q6_K_R8: kernels/csrc/quant_r8.c), made at load on AVX512-VNNI machines: the
repack and its inverse give back the file's bytes exactly (the native one against the torch
reading of the layout), and every product over the repacked rows (the VNNI one-row tiles, the
panel GEMM, the other paths' fallback, dequantization) gives the numbers of the same product
over the file's rows: the integer sums are the same, only the order of the fp32 sums differs
(the GEMM's, not even that)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels import quant_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    Q4_0,
    Q4_0_R8,
    Q4_K,
    Q4_K_R8,
    Q5_0,
    Q5_0_R8,
    Q6_K,
    Q6_K_R8,
    Q8_0,
    Q8_0_R8,
    decode_layout,
    dequantize_cpu,
    linear_quant_cpu,
    repack_r8,
    unpack_r8,
)
from asyncengine.kernels.quant_formats import (
    FORMATS,
    LEGACY,
    dequantize,
    r8_to_q4_k,
    r8_to_q5_0,
    r8_to_q6_k,
    r8_to_q8_0,
    random_blocks,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
]
PATHS_HERE = quant_cpu.available_paths() if load_native() is not None else ()
SHAPES = [(8, 256), (24, 768), (136, 2304), (64, 2048)]  # N x K
# the file's format: its interleaved one
R8 = {Q4_K: Q4_K_R8, Q8_0: Q8_0_R8, Q5_0: Q5_0_R8, Q4_0: Q4_0_R8, Q6_K: Q6_K_R8}
READ_BACK = {  # the torch readings of the layouts
    Q4_K_R8: r8_to_q4_k,
    Q8_0_R8: r8_to_q8_0,
    Q5_0_R8: r8_to_q5_0,
    Q4_0_R8: lambda w: r8_to_q5_0(w, Q4_0_R8),
    Q6_K_R8: r8_to_q6_k,
}
FILE_FORMATS = pytest.mark.parametrize("qtype", list(R8))


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    quant_cpu.set_path(None)


def _file_rows(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows of a file's `qtype` (the legacy formats as their quantizer writes them)."""
    if qtype in LEGACY:
        return quant_cpu.quantize_weight(torch.randn(n, k, generator=gen) * 0.02, qtype)
    return random_blocks(qtype, n, k, gen)


@FILE_FORMATS
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_repack_gives_back_the_same_bytes(shape: tuple[int, int], qtype: str) -> None:
    n, k = shape
    rows = _file_rows(qtype, n, k, torch.Generator().manual_seed(n + k))
    r8 = repack_r8(rows, qtype)
    assert r8.shape == rows.shape and not torch.equal(r8, rows)
    assert torch.equal(unpack_r8(r8, R8[qtype]), rows)
    assert torch.equal(READ_BACK[R8[qtype]](r8), rows)  # the torch reading agrees
    # any bytes in the layout are a weight: the inverse is exact both ways
    other = random_blocks(R8[qtype], n, k, torch.Generator().manual_seed(1))
    assert torch.equal(repack_r8(unpack_r8(other, R8[qtype]), qtype), other)


@FILE_FORMATS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantized_values_are_the_files_rows(dtype: torch.dtype, qtype: str) -> None:
    rows = _file_rows(qtype, 40, 512, torch.Generator().manual_seed(2))
    r8 = repack_r8(rows, qtype)
    assert torch.equal(dequantize(r8, R8[qtype]), dequantize(rows, qtype))
    want = dequantize_cpu(rows, qtype, dtype)
    assert torch.equal(dequantize_cpu(r8, R8[qtype], dtype), want)


@FILE_FORMATS
@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_products_equal_the_files_products(
    shape: tuple[int, int], dtype: torch.dtype, path: str, qtype: str
) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(3 * n + k)
    rows = _file_rows(qtype, n, k, gen)
    r8 = repack_r8(rows, qtype)
    quant_cpu.set_path(path)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):  # the tiles of 1-4 rows, several tiles, the GEMM
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        x[0, :256] = 0  # a zero activation block
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if m % 2 else None
        want = linear_quant_cpu(x, rows, qtype, bias).double()
        got = linear_quant_cpu(x, r8, R8[qtype], bias).double()
        # fp32 sums in another order, then one rounding to dtype (either way for a tie)
        tol = 1e-5 * want.abs().max() + torch.finfo(dtype).eps * want.abs()
        assert torch.all((got - want).abs() <= tol), (m, path, (got - want).abs().max())


@FILE_FORMATS
def test_the_rows_of_a_group_are_not_mixed(qtype: str) -> None:
    # one non-zero weight row at a time: only its output moves
    gen = torch.Generator().manual_seed(4)
    rows = random_blocks(qtype, 16, 256, gen)
    blocks = rows.view(16, -1, FORMATS[qtype].nbytes)
    d_at = 208 if qtype == Q6_K else 0  # the block's fp16 d (Q4_K's dmin after it)
    blocks[:, :, d_at : d_at + (4 if qtype == Q4_K else 2)] = 0  # every weight zero
    x = torch.randn(1, 256, generator=gen)
    for row in (0, 5, 8, 15):
        one = rows.clone()
        one.view(16, -1, blocks.shape[-1])[row, :, d_at + 1] = 0x3C  # d = 1.0
        out = linear_quant_cpu(x, repack_r8(one, qtype), R8[qtype])[0]
        assert out[row] != 0 and torch.count_nonzero(out) == 1
        torch.testing.assert_close(out, linear_quant_cpu(x, one, qtype)[0], rtol=1e-5, atol=0)


@FILE_FORMATS
def test_weights_not_in_groups_of_8_rows_are_refused(qtype: str) -> None:
    rows = random_blocks(qtype, 12, 256, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="multiple of 8"):
        repack_r8(rows, qtype)
    r8 = repack_r8(rows[:8].contiguous(), qtype)
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_quant_cpu(torch.randn(1, 256), torch.cat([r8, r8[:4]]), R8[qtype])
    with pytest.raises(ValueError, match="multiple of 8"):
        random_blocks(R8[qtype], 12, 256, torch.Generator())
    with pytest.raises(ValueError, match="no 8-row interleaved layout"):
        repack_r8(random_blocks("q5_k", 8, 256, torch.Generator()), "q5_k")


@FILE_FORMATS
def test_the_decode_layout_is_interleaved_on_the_vnni_path_only(
    monkeypatch: pytest.MonkeyPatch, qtype: str
) -> None:
    monkeypatch.setattr(quant_cpu, "Q5_0_AS_BYTES", False)  # (test_quant_q5_0_bytes.py's)
    gen = torch.Generator().manual_seed(6)
    rows = random_blocks(qtype, 16, 256, gen)
    q5k = random_blocks("q5_k", 16, 256, gen)
    assert decode_layout(q5k, "q5_k") == (q5k, "q5_k")
    assert decode_layout(rows[:12].contiguous(), qtype)[1] == qtype  # not whole groups
    for path in PATHS_HERE:
        quant_cpu.set_path(path)
        weight, layout = decode_layout(rows, qtype)
        if path == "avx512_vnni":
            assert layout == R8[qtype] and torch.equal(weight, repack_r8(rows, qtype))
        else:
            assert layout == qtype and weight is rows
    quant_cpu.set_path(None)
    monkeypatch.setattr(quant_cpu, "REPACK_R8", False)
    assert decode_layout(rows, qtype) == (rows, qtype)


@FILE_FORMATS
def test_an_embedding_reads_its_rows_from_the_interleaved_layout(qtype: str) -> None:
    from asyncengine.model.quant_linear import QuantEmbedding

    rows = _file_rows(qtype, 48, 256, torch.Generator().manual_seed(7))
    short = torch.tensor([5, 47, 0, 5, 8, 15, 16, 33])  # repeats, one group twice, unsorted
    long = torch.randint(0, 48, (100,), generator=torch.Generator().manual_seed(8))
    # one stream's step, a few streams', a prefill chunk's many (groups once)
    for ids in (torch.tensor([45]), short, long):
        want = QuantEmbedding(rows, qtype, torch.bfloat16)(ids)
        got = QuantEmbedding(repack_r8(rows, qtype), R8[qtype], torch.bfloat16)(ids)
        assert torch.equal(got, want)
        assert torch.equal(want, dequantize(rows, qtype)[ids].bfloat16())
