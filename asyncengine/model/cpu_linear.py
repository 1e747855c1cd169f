"""Prepacked bf16/fp16 linear layers for CPUs (oneDNN).

`F.linear` with bf16 weights on a CPU hands oneDNN a plain row-major weight on every call,
which oneDNN first reorders into its blocked layout: for decode-sized batches that reorder
costs more than the product itself. Reordering once, at load time, makes one-token steps'
linears about 2x faster and 64-token batches' about 15% (measured on this machine's
AVX512-BF16 cores), with bitwise the same results: the same oneDNN kernel runs either way.

`pack_linear_layers(model)` swaps every `nn.Linear` for a `PackedLinear` holding the
reordered weight (the lm_head too; a tied embedding keeps its own plain copy). It checks the
packed path against `F.linear` once and leaves the model as it is if they differ or oneDNN
lacks the dtype, so an unusual build of torch only loses the speed-up.

Decode-sized bf16 products (up to NATIVE_MAX_ROWS rows; NATIVE_MAX_ROWS_AMX on CPUs with AMX,
where oneDNN's tile kernels win from a few rows up) skip oneDNN: the native kernels
(`kernels/linear_cpu.py`) read the same packed weight with AVX512-BF16 dot products:
one-row products at close to the memory bandwidth, where oneDNN's reach about half of it and
pay more per call; with more rows they compute as fast as oneDNN on cached weights and stream
the next block of weights in meanwhile, where oneDNN waits for them. Their sums run in another
order, so those rows may differ from `F.linear` in the last bit (rarely: about one value in
50,000 on SmolLM2's shapes). They are used only where they were built with AVX512-BF16 and the
packed weight is in the layout they read (checked per layer).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.linear_cpu import NATIVE_BLOCK, LinearCpu, prepare_linear_cpu
from asyncengine.kernels.linear_dense_cpu import (
    dense_kernels,
    linear_bf16_dense,
    pack_dense,
    unpack_dense,
)
from asyncengine.model.weight_arena import WeightArena

logger = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16)
_BATCH_HINT = 64  # the layout oneDNN picks barely depends on it (measured: within 5%)
# Products of up to this many rows run in the native kernel. Measured on SmolLM2's 30 layers
# and lm_head, weights cycled (so coming from memory, as in a step), oneDNN against native:
# 1 row 6.4-7.4 against 4.3-5.9 ms, 64 rows 27-28 against 23-24 ms, 96 rows 36.8 against
# 34.3, 128 rows 45.4 against 44.5, 256 rows 85 against 87. Longer (prefill) products stay
# with oneDNN, which is ahead there.
NATIVE_MAX_ROWS = 128
# On CPUs with AMX, oneDNN packs for its tile kernels (the native kernels then read a copy of
# their own) and runs from a few rows up far faster than they do. Measured on 2 Emerald Rapids
# cores, SmolLM2's 121 linears, oneDNN against native: 1 row 22-23 against 15 ms, 4 rows 16-20
# against 16, 6 rows 16.2 against 17.5, 64 rows 34 against 175 ms.
NATIVE_MAX_ROWS_AMX = 4


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout; same inputs, same outputs."""

    def __init__(self, linear: nn.Linear | DenseLinear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        # An opaque mkldnn tensor: kept as a plain attribute, outside the state dict.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), _BATCH_HINT
        )
        self.bias = linear.bias
        self._native = prepare_linear_cpu(linear.weight, self.bias, self.packed_weight)

    @property
    def native(self) -> LinearCpu | None:
        """The native kernels' product over this weight; None where they do not apply."""
        return self._native

    @property
    def native_max_rows(self) -> int:
        """The most rows a product runs in the native kernel for (0 where it has none)."""
        native = self._native
        if native is None:
            return 0
        return min(NATIVE_MAX_ROWS, NATIVE_MAX_ROWS_AMX) if native.own_copy else NATIVE_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        native = self._native
        if native is not None and x.dtype == torch.bfloat16:
            rows = x.numel() // self.in_features
            if 0 < rows <= self.native_max_rows:
                return native(x.reshape(rows, self.in_features)).view(*x.shape[:-1], -1)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu(g) * u` of this joint [gate; up] layer's output halves `g`, `u` for x [rows,
        in], in one native call, bit for bit `silu_mul_cpu` of `forward(x)`'s halves; None
        where that path does not apply (not bf16, more than native_max_rows rows, halves not
        whole 64-column blocks): the caller then runs the two steps."""
        native = self._native_for(x)
        if native is None or self.out_features % (2 * NATIVE_BLOCK):
            return None
        return native.silu_mul(x)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """`rms_norm_cpu(forward(x), weight, eps, residual)` in one native call, bit for bit:
        `residual += forward(x)` in place, and its RMSNorm returned. None where that path
        does not apply (not bf16, more than native_max_rows rows, a residual whose rows are not
        contiguous, a width that is not a multiple of 16): the caller runs the two steps."""
        native = self._native_for(x)
        n = self.out_features
        if native is None or n % 16 or residual.shape != (x.shape[0], n):
            return None
        if residual.stride(-1) != 1 or {residual.dtype, weight.dtype} != {torch.bfloat16}:
            return None
        return native.add_rms_norm(x, residual, weight, eps)

    def _native_for(self, x: torch.Tensor) -> LinearCpu | None:
        """The native kernel, where it takes x: bf16 rows [rows, in], 1 to native_max_rows."""
        native = self._native
        if native is None or x.dtype != torch.bfloat16 or x.dim() != 2:
            return None
        return native if 0 < x.shape[0] <= self.native_max_rows else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class DenseLinear(nn.Module):
    """`x @ weight.T + bias` over given tensors: `nn.Linear` without its initialisation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class NativeDenseLinear(nn.Module):
    """A bf16 linear layer on the native AVX2 kernel (kernels/linear_dense_cpu.py), for CPUs
    where oneDNN has no bf16 path. It holds the weight only in the kernel's packed layout
    (`packed`, made once here, in `arena` where given); `weight` unpacks a plain copy for the
    rare caller that wants it."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, arena: WeightArena | None = None
    ) -> None:
        super().__init__()
        lib = dense_kernels()
        assert lib is not None, "NativeDenseLinear needs the AVX2 build of the native kernels"
        self._lib = lib
        self.out_features, self.in_features = weight.shape
        # A plain attribute, outside the state dict (as PackedLinear's oneDNN weight).
        packed = pack_dense(lib, weight.detach())
        self.packed = packed if arena is None else arena.copy(packed)
        self.bias = None if bias is None else bias.detach().contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight [out, in], unpacked (a new tensor on every call)."""
        return unpack_dense(self._lib, self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features)
        out = linear_bf16_dense(self._lib, rows, self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native dense"


def packs(dtype: torch.dtype) -> bool:
    """Whether `linear_layer` packs CPU weights of this dtype."""
    return dtype in _PACKABLE and _packing_works(dtype)


def linear_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, arena: WeightArena | None = None
) -> nn.Module:
    """A linear layer over `weight` [out, in] and `bias`: packed where `pack_linear_layers`
    would pack it, the native dense bf16 kernel where oneDNN lacks bf16 (AVX2 CPUs; its panels
    in the load's `arena` where given: model/weight_arena.py), plain otherwise. Gives
    `F.linear(x, weight, bias)`'s numbers (up to the order of fp32 sums)."""
    dense = DenseLinear(weight, bias)
    if weight.device.type == "cpu" and packs(weight.dtype):
        return PackedLinear(dense)
    if _dense_native(weight):
        return NativeDenseLinear(weight, bias, arena)
    return dense


def pack_linear_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap `model`'s linear layers for packed ones when that is safe; the count swapped."""
    if dtype not in _PACKABLE or not _packing_works(dtype):
        return _use_dense_native(model, dtype)
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == dtype and m.weight.device.type == "cpu"
    ]
    for name, module in linears:
        model.set_submodule(name, PackedLinear(module))
    logger.info("packed %d linear layers for oneDNN", len(linears))
    return len(linears)


def _dense_native(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and dense_kernels() is not None
    )


def _use_dense_native(model: nn.Module, dtype: torch.dtype) -> int:
    """Where oneDNN cannot pack bf16: swap bf16 `nn.Linear`s for NativeDenseLinear; the count."""
    if dtype != torch.bfloat16 or dense_kernels() is None:
        return 0
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and _dense_native(m.weight)
    ]
    for name, module in linears:
        model.set_submodule(name, NativeDenseLinear(module.weight, module.bias))
    logger.info("%d bf16 linear layers run on the native AVX2 kernel", len(linears))
    return len(linears)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """oneDNN is there, takes this dtype, and gives F.linear's numbers on a small case."""
    try:
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return False
        g = torch.Generator().manual_seed(0)
        probe = nn.Linear(64, 48, dtype=dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(48, 64, generator=g))
        x = torch.randn(3, 64, generator=g).to(dtype)
        with torch.inference_mode():
            ok = torch.equal(PackedLinear(probe)(x), F.linear(x, probe.weight, probe.bias))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN weight packing unavailable (%s): using F.linear", exc)
        return False
    if not ok:
        logger.info("oneDNN packed linear differs from F.linear here: using F.linear")
    return ok
