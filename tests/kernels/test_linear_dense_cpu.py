"""The native dense bf16 linear kernel (kernels/linear_dense_cpu.py, for CPUs without
AVX512-BF16): its packed weight layout, fp32 products' numbers on awkward shapes, and the
layers that route to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.cpu_native import NativeKernels, load_native, unavailable_reason
from asyncengine.kernels.linear_dense_cpu import (
    dense_kernels,
    linear_bf16_dense,
    pack_dense,
    unpack_dense,
)
from asyncengine.model import cpu_linear

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
]


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 values, in fp32 (before the one rounding to bf16)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _assert_rounds_to(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    # One rounding of an fp32 sum: within half a bf16 ulp of the exact value (eps is a whole
    # ulp), plus what another order of the fp32 additions can move it: a few fp32 ulps of the
    # sum of the terms' magnitudes (`magnitude`), which matters where the terms cancel.
    bound = torch.finfo(torch.bfloat16).eps * ref.abs() + 2.0**-18 * magnitude
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.all((out.float() - ref).abs() <= bound), (out.float() - ref).abs().max()


def _dense(
    lib: NativeKernels, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    return linear_bf16_dense(lib, x, pack_dense(lib, w), w.shape[0], b)


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    magnitude = F.linear(x.float().abs(), w.float().abs())
    _assert_rounds_to(out, _reference(x, w, b), magnitude)


def test_packing_lays_panels_out_k_major_and_unpacks_to_the_weight() -> None:
    lib = load_native()
    assert lib is not None
    order = lib.dense_panel_order
    assert sorted(order) == list(range(16))
    w = torch.randn(37, 5).bfloat16()  # three panels, the last with 5 rows and 11 of padding
    packed = pack_dense(lib, w)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.bfloat16
    for n in range(37):
        for k in range(5):
            assert packed[n // 16, k, order[n % 16]] == w[n, k]
    assert torch.all(packed[2, :, [order[j] for j in range(5, 16)]] == 0)
    assert torch.equal(unpack_dense(lib, packed, 37), w)


# One row runs the panel-wise dot products, more rows the register-blocked GEMM: its 6-row
# blocks with 1-5 left over, 16-column panels with a short last one split between the threads,
# K past one 256-step slice and not a multiple of 8 (nor of 4, the one-row loop's step).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 131])
@pytest.mark.parametrize(("n", "k"), [(96, 256), (100, 70), (7, 9), (1001, 333), (5, 1), (48, 600)])
def test_products_match_fp32_on_awkward_shapes(rows: int, n: int, k: int) -> None:
    lib = load_native()
    assert lib is not None
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if n % 2 == 0 else None
    # rows with a stride of their own: every other row of a wider tensor's leading columns
    wide = torch.randn(2 * rows, k + 3, generator=g).bfloat16()
    x = wide[::2, :k]
    _check(_dense(lib, x, w, bias), x, w, bias)


@pytest.mark.parametrize("rows", [8, 300])
def test_a_large_panel_of_rows_and_columns(rows: int) -> None:
    # a width past the thread split, and one chunk of 300 rows (K = 1536 allows 336)
    lib = load_native()
    assert lib is not None
    g = torch.Generator().manual_seed(7)
    w = torch.randn(777, 1536, generator=g).bfloat16()
    b = torch.randn(777, generator=g).bfloat16()
    x = torch.randn(rows, 1536, generator=g).bfloat16()
    _check(_dense(lib, x, w, b), x, w, b)


def test_long_prefills_take_the_rows_in_chunks() -> None:
    # K = 4096: a chunk is 126 rows (2 MB of fp32 x), so 400 rows are four chunks, the last short
    lib = load_native()
    assert lib is not None
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 4096, generator=g).bfloat16()
    x = torch.randn(400, 4096, generator=g).bfloat16()
    _check(_dense(lib, x, w, None), x, w, None)


def test_specials_round_as_torch_rounds() -> None:
    # NaN stays NaN and infinities stay infinite through the GEMM's vector rounding
    lib = load_native()
    assert lib is not None
    w = torch.ones(16, 8).bfloat16()
    x = torch.ones(6, 8).bfloat16()
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 0] = -float("inf")
    x[4, 0] = 3e38  # the sum overflows fp32
    out = _dense(lib, x, w, None).float()
    expected = F.linear(x.float(), w.float()).bfloat16().float()
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


def test_layers_route_bf16_to_the_kernel_where_onednn_cannot_pack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if dense_kernels() is None:
        pytest.skip("the native kernels were built without AVX2 and FMA")
    monkeypatch.setattr(cpu_linear, "_packing_works", lambda dtype: False)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 40, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    layer = cpu_linear.linear_layer(w, b)
    assert isinstance(layer, cpu_linear.NativeDenseLinear)
    assert torch.equal(layer.weight, w)  # unpacked from the only copy it holds
    held = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert not any(v.shape == w.shape for v in held)  # no plain copy kept beside the packed one
    x = torch.randn(2, 3, 40, generator=g).bfloat16()  # leading dims are kept
    _check(layer(x), x, w, b)
    # fp32 inputs (a caller upcasting) still get F.linear's numbers
    assert torch.allclose(layer(x.float()), F.linear(x.float(), w.float(), b.float()))
    # fp32 weights keep the plain layer
    assert type(cpu_linear.linear_layer(w.float(), None)) is cpu_linear.DenseLinear

    model = nn.Sequential(nn.Linear(40, 24), nn.SiLU(), nn.Linear(24, 8, bias=False))
    model = model.to(torch.bfloat16)
    expected = model(x)
    assert cpu_linear.pack_linear_layers(model, torch.bfloat16) == 2
    assert all(isinstance(model[i], cpu_linear.NativeDenseLinear) for i in (0, 2))
    assert torch.allclose(model(x).float(), expected.float(), rtol=2e-2, atol=2e-2)
