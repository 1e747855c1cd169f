"""Q4_K weights with every 8 rows interleaved (Q4_K_R8: kernels/csrc/quant_r8.c), made at
load on AVX512-VNNI machines: the repack and its inverse give back the file's bytes exactly (the
native one against the torch reading of the layout), and every product over the repacked rows
(the VNNI one-row tiles, the panel GEMM, the other paths' fallback, dequantization) gives the
numbers of the same product over the Q4_K rows: the integer sums are the same, only the order
of the fp32 sums differs (the GEMM's, not even that)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels import quant_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import (
    Q4_K,
    Q4_K_R8,
    decode_layout,
    dequantize_cpu,
    linear_quant_cpu,
    repack_q4_k_r8,
    unpack_q4_k_r8,
)
from asyncengine.kernels.quant_formats import dequantize, r8_to_q4_k, random_blocks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
]
PATHS_HERE = quant_cpu.available_paths() if load_native() is not None else ()
SHAPES = [(8, 256), (24, 768), (136, 2304), (64, 2048)]  # N x K


@pytest.fixture(autouse=True)
def _best_path_after() -> Iterator[None]:
    yield
    quant_cpu.set_path(None)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_repack_gives_back_the_same_bytes(shape: tuple[int, int]) -> None:
    n, k = shape
    q4k = random_blocks(Q4_K, n, k, torch.Generator().manual_seed(n + k))
    r8 = repack_q4_k_r8(q4k)
    assert r8.shape == q4k.shape and not torch.equal(r8, q4k)
    assert torch.equal(unpack_q4_k_r8(r8), q4k)
    assert torch.equal(r8_to_q4_k(r8), q4k)  # the torch reading of the layout agrees
    # any bytes in the layout are a weight: the inverse is exact both ways
    other = random_blocks(Q4_K_R8, n, k, torch.Generator().manual_seed(1))
    assert torch.equal(repack_q4_k_r8(unpack_q4_k_r8(other)), other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantized_values_are_the_q4_k_rows(dtype: torch.dtype) -> None:
    q4k = random_blocks(Q4_K, 40, 512, torch.Generator().manual_seed(2))
    r8 = repack_q4_k_r8(q4k)
    assert torch.equal(dequantize(r8, Q4_K_R8), dequantize(q4k, Q4_K))
    assert torch.equal(dequantize_cpu(r8, Q4_K_R8, dtype), dequantize_cpu(q4k, Q4_K, dtype))


@pytest.mark.parametrize("path", PATHS_HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_products_equal_the_q4_k_products(
    shape: tuple[int, int], dtype: torch.dtype, path: str
) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(3 * n + k)
    q4k = random_blocks(Q4_K, n, k, gen)
    r8 = repack_q4_k_r8(q4k)
    quant_cpu.set_path(path)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):  # the tiles of 1-4 rows, several tiles, the GEMM
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        x[0, :256] = 0  # a zero activation super-block
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if m % 2 else None
        want = linear_quant_cpu(x, q4k, Q4_K, bias).double()
        got = linear_quant_cpu(x, r8, Q4_K_R8, bias).double()
        # fp32 sums in another order, then one rounding to dtype (either way for a tie)
        tol = 1e-5 * want.abs().max() + torch.finfo(dtype).eps * want.abs()
        assert torch.all((got - want).abs() <= tol), (m, path, (got - want).abs().max())


def test_the_rows_of_a_group_are_not_mixed() -> None:
    # one non-zero weight row at a time: only its output moves
    gen = torch.Generator().manual_seed(4)
    q4k = random_blocks(Q4_K, 16, 256, gen)
    q4k.view(16, 144)[:, :4] = 0  # d and dmin zero: every row's weights are zero
    x = torch.randn(1, 256, generator=gen)
    for row in (0, 5, 8, 15):
        one = q4k.clone()
        one[row, :4] = torch.tensor([0x00, 0x3C, 0x00, 0x00], dtype=torch.uint8)  # d = 1.0
        out = linear_quant_cpu(x, repack_q4_k_r8(one), Q4_K_R8)[0]
        assert out[row] != 0 and torch.count_nonzero(out) == 1
        torch.testing.assert_close(out, linear_quant_cpu(x, one, Q4_K)[0], rtol=1e-5, atol=0)


def test_weights_not_in_groups_of_8_rows_are_refused() -> None:
    q4k = random_blocks(Q4_K, 12, 256, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="multiple of 8"):
        repack_q4_k_r8(q4k)
    r8 = repack_q4_k_r8(q4k[:8].contiguous())
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_quant_cpu(torch.randn(1, 256), torch.cat([r8, r8[:4]]), Q4_K_R8)
    with pytest.raises(ValueError, match="multiple of 8"):
        random_blocks(Q4_K_R8, 12, 256, torch.Generator())


def test_the_decode_layout_is_q4_k_r8_on_the_vnni_path_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(6)
    q4k = random_blocks(Q4_K, 16, 256, gen)
    q6k = random_blocks("q6_k", 16, 256, gen)
    assert decode_layout(q6k, "q6_k") == (q6k, "q6_k")
    assert decode_layout(q4k[:12].contiguous(), Q4_K)[1] == Q4_K  # not whole groups
    for path in PATHS_HERE:
        quant_cpu.set_path(path)
        weight, qtype = decode_layout(q4k, Q4_K)
        if path == "avx512_vnni":
            assert qtype == Q4_K_R8 and torch.equal(weight, repack_q4_k_r8(q4k))
        else:
            assert qtype == Q4_K and weight is q4k
    quant_cpu.set_path(None)
    monkeypatch.setattr(quant_cpu, "REPACK_Q4_K", False)
    assert decode_layout(q4k, Q4_K) == (q4k, Q4_K)
