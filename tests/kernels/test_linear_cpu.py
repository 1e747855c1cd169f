"""The native decode-sized bf16 linear kernels (kernels/linear_cpu.py) over oneDNN's packed
weights or their own copy: fp32 products' numbers on awkward shapes, the portable build, the
own packing and the layout check.
PackedLinear, which routes layers to them, and the fused variants are tested with the model
code (tests/model/test_cpu_linear.py)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import cpu_native, linear_cpu
from asyncengine.kernels.cpu_native import load_native, unavailable_reason

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
)


def _call_native(lib: object, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    n, k = weight.shape
    packed, packed_k = linear_cpu.native_layout(weight, packed)  # (own copy on AMX CPUs)
    out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
    lib.linear_bf16(  # type: ignore[attr-defined]
        x.data_ptr(), x.stride(0), x.shape[0], linear_cpu.address_of(packed), n, k, packed_k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, 2,
    )  # fmt: skip
    return out


def check_native_linear(lib: object) -> None:
    """The native kernel against fp32 products over oneDNN's packing of awkward shapes: widths
    that are not whole 64-column blocks, odd and short input widths, 1-13 and 64 rows, strided
    rows, with and without bias."""
    g = torch.Generator().manual_seed(3)
    for n, k in [(96, 256), (100, 70), (7, 9), (1000, 333), (64, 1)]:
        weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        for rows in (*range(1, 14), 64):
            wide = torch.randn(rows, k + 5, generator=g).to(torch.bfloat16)
            x = wide[:, 2 : 2 + k]  # rows k + 5 apart, an odd start
            for b in (bias, None):
                got = _call_native(lib, x, packed, weight, b)
                want = x.float() @ weight.float().T + (0 if b is None else b.float())
                # one bf16 rounding of an fp32 sum: within half a bf16 step, plus fp32 noise
                tol = want.abs() * 2**-8 + 1e-3 * (k**0.5)
                assert bool(((got.float() - want).abs() <= tol).all()), (n, k, rows)


@pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
def test_native_linear_reads_the_packed_weight() -> None:
    check_native_linear(load_native())


@pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march names")
def test_native_linear_portable_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without AVX512-BF16 the kernel runs its portable loops (and no layer is routed to it).
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64")
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None and not lib.linear_bf16_fast
        check_native_linear(lib)
        weight = torch.zeros(64, 64, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        assert linear_cpu.prepare_linear_cpu(weight, None, packed) is None
    finally:
        cpu_native.load_native.cache_clear()


def _onednn_packs_as_native() -> bool:
    """Whether oneDNN packs bf16 weights in the native kernels' layout on this CPU (not where
    it packs for AMX tiles)."""
    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    return linear_cpu._packed_k(weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)) == 64


def test_own_packing_is_the_layout_the_kernels_read() -> None:
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(100, 7, generator=g).to(torch.bfloat16)  # a short block, odd width
    packed, packed_k = linear_cpu.pack_native(weight)
    assert packed_k == 8 and packed.shape == (2, 4, 64, 2)
    for n, k in [(0, 0), (63, 6), (64, 1), (99, 3)]:
        assert packed[n // 64, k // 2, n % 64, k % 2] == weight[n, k]
    assert torch.all(packed[1, :, 36:] == 0) and torch.all(packed[:, 3, :, 1] == 0)
    if _onednn_packs_as_native():  # byte for byte what oneDNN lays out, where it uses it
        square = torch.randn(128, 64, generator=g).to(torch.bfloat16)
        onednn = torch.ops.mkldnn._reorder_linear_weight(square, 64)
        own = linear_cpu.pack_native(square)[0].flatten()
        assert linear_cpu._packed_k(square, onednn) == 64
        assert torch.ops.mkldnn._nbytes(onednn) == own.numel() * 2
        raw = (ctypes.c_uint16 * own.numel()).from_address(torch.ops.mkldnn.data_ptr(onednn))
        assert torch.equal(torch.frombuffer(raw, dtype=torch.int16), own.view(torch.int16))


@pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
def test_a_packing_in_another_layout_is_refused() -> None:
    if not _onednn_packs_as_native():
        pytest.skip("oneDNN packs bf16 in another layout on this CPU (AMX tiles)")
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(128, 64, generator=g).to(torch.bfloat16)
    assert linear_cpu._packed_k(weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)) == 64
    # Another weight's packing (as a layout the sample check does not recognise would be).
    other_weight = torch.randn(128, 64, generator=g).to(torch.bfloat16)
    other = torch.ops.mkldnn._reorder_linear_weight(other_weight, 64)
    assert linear_cpu._packed_k(weight, other) is None
    # A packing of another size.
    smaller = torch.ops.mkldnn._reorder_linear_weight(weight[:, :32].contiguous(), 64)
    assert linear_cpu._packed_k(weight, smaller) is None


@pytest.mark.skipif(load_native() is None, reason=unavailable_reason())
def test_rows_gathered_from_the_packed_weight_are_the_weights_rows() -> None:
    """A tied embedding's lookup reads the lm_head's packed weight (LinearCpu.rows)."""
    lib = load_native()
    if lib is None or not lib.linear_bf16_fast:
        pytest.skip("the native kernel's fast path is not built (AVX512-BF16)")
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(300, 77, generator=g).to(torch.bfloat16)  # odd width, a short block
    layer = linear_cpu.prepare_linear_cpu(
        weight, None, torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    )
    assert layer is not None
    ids = torch.tensor([0, 299, 64, 63, 5, 5, 200])
    rows = layer.rows(ids)
    assert rows.is_contiguous() and torch.equal(rows, weight[ids])
    rows.add_(1)  # a new tensor: the weight is untouched
    assert torch.equal(layer.rows(ids), weight[ids])
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        layer.rows(torch.tensor([300]))
