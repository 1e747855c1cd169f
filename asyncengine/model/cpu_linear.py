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

Decode-sized bf16 products (up to NATIVE_MAX_ROWS rows) skip oneDNN: the native kernel
(`kernels/csrc/cpu_linear.c`) reads the same packed weight with AVX512-BF16 dot products:
one-row products at close to the memory bandwidth, where oneDNN's reach about half of it and
pay more per call; with more rows it computes as fast as oneDNN on cached weights and streams
the next block of weights in meanwhile, where oneDNN waits for them. Its sums run in another
order, so those rows may differ from `F.linear` in the last bit (rarely: about one value in
50,000 on SmolLM2's shapes). It is used only where it was built with AVX512-BF16 and the
packed weight is in the layout it reads (checked per layer).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.cpu_native import NativeKernels, load_native

logger = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16)
_BATCH_HINT = 64  # the layout oneDNN picks barely depends on it (measured: within 5%)
# Products of up to this many rows run in the native kernel. Measured on SmolLM2's 30 layers
# and lm_head, weights cycled (so coming from memory, as in a step), oneDNN against native:
# 1 row 6.4-7.4 against 4.3-5.9 ms, 64 rows 27-28 against 23-24 ms, 96 rows 36.8 against
# 34.3, 128 rows 45.4 against 44.5, 256 rows 85 against 87. Longer (prefill) products stay
# with oneDNN, which is ahead there.
NATIVE_MAX_ROWS = 128
_NATIVE_BLOCK = 64  # output columns per block of the packed layout the kernel reads


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
        self._native = _native_product(linear.weight, self.bias, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        native = self._native
        if native is not None and x.dtype == torch.bfloat16:
            rows = x.numel() // self.in_features
            if 0 < rows <= NATIVE_MAX_ROWS:
                return native(x.reshape(rows, self.in_features)).view(*x.shape[:-1], -1)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu(g) * u` of this joint [gate; up] layer's output halves `g`, `u` for x [rows,
        in], in one native call, bit for bit `silu_mul_cpu` of `forward(x)`'s halves; None
        where that path does not apply (not bf16, more than NATIVE_MAX_ROWS rows, halves not
        whole 64-column blocks): the caller then runs the two steps."""
        native = self._native_for(x)
        if native is None or self.out_features % (2 * _NATIVE_BLOCK):
            return None
        return native.silu_mul(x)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """`add_rms_norm_cpu(forward(x), residual, weight, eps)` in one native call, bit for
        bit: `residual += forward(x)` in place, and its RMSNorm returned. None where that path
        does not apply (not bf16, more than NATIVE_MAX_ROWS rows, a residual whose rows are not
        contiguous, a width that is not a multiple of 16): the caller runs the two steps."""
        native = self._native_for(x)
        n = self.out_features
        if native is None or n % 16 or residual.shape != (x.shape[0], n):
            return None
        if residual.stride(-1) != 1 or {residual.dtype, weight.dtype} != {torch.bfloat16}:
            return None
        return native.add_rms_norm(x, residual, weight, eps)

    def _native_for(self, x: torch.Tensor) -> _NativeProduct | None:
        """The native kernel, where it takes x: bf16 rows [rows, in], 1 to NATIVE_MAX_ROWS."""
        native = self._native
        if native is None or x.dtype != torch.bfloat16 or x.dim() != 2:
            return None
        return native if 0 < x.shape[0] <= NATIVE_MAX_ROWS else None

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


class _NativeProduct:
    """x [rows, in] -> x @ weight.T + bias by the native kernel over oneDNN's packed weight."""

    def __init__(self, lib: NativeKernels, packed: torch.Tensor, packed_k: int,
                 shape: tuple[int, int], bias: torch.Tensor | None) -> None:  # fmt: skip
        self._lib = lib
        self._packed = packed  # the kernel reads its memory: keep it alive
        self._address = torch.ops.mkldnn.data_ptr(packed)
        self._packed_k = packed_k
        self._n, self._k = shape
        self._bias = None if bias is None else bias.detach().contiguous()
        self._bias_address = None if self._bias is None else self._bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self._n, dtype=torch.bfloat16)
        self._lib.linear_bf16(
            x.data_ptr(), x.stride(0), x.shape[0], self._address, self._n, self._k,
            self._packed_k, self._bias_address, out.data_ptr(), self._n, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += the product, in place; its RMSNorm times weight (see PackedLinear)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        product = torch.empty(rows, self._n, dtype=torch.bfloat16)
        out = torch.empty(rows, self._n, dtype=torch.bfloat16)
        w = weight.contiguous()
        self._lib.linear_add_rms_norm_bf16(
            x.data_ptr(), x.stride(0), rows, self._address, self._n, self._k, self._packed_k,
            self._bias_address, product.data_ptr(), residual.data_ptr(), residual.stride(0),
            w.data_ptr(), eps, out.data_ptr(), self._n, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(g) * u for this [gate; up] product's halves (n a multiple of 128)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        inter = self._n // 2
        out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
        self._lib.linear_silu_bf16(
            x.data_ptr(), x.stride(0), x.shape[0], self._address, self._n, self._k,
            self._packed_k, self._bias_address, out.data_ptr(), inter, torch.get_num_threads(),
        )  # fmt: skip
        return out


def _native_product(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> _NativeProduct | None:
    """The native kernel's product over `packed`, or None where it does not apply: not bf16,
    not built with AVX512-BF16, or packed in another layout."""
    if weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    lib = load_native()
    if lib is None or not lib.linear_bf16_fast:
        return None
    packed_k = _packed_k(weight, packed)
    if packed_k is None:
        logger.info("oneDNN packed a %s weight in a layout the native kernel does not read",
                    tuple(weight.shape))  # fmt: skip
        return None
    n, k = weight.shape
    return _NativeProduct(lib, packed, packed_k, (n, k), bias)


def _packed_k(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The padded input extent of `packed` if it holds `weight` as the native kernel reads it,
    [ceil(out / 64)][in_padded / 2][64][2]: checked on the sizes and on a sample of values."""
    n, k = weight.shape
    blocks = -(-n // _NATIVE_BLOCK)
    try:
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (RuntimeError, AttributeError):  # a torch without these accessors
        return None
    packed_k, rest = divmod(nbytes // 2, blocks * _NATIVE_BLOCK)
    if nbytes % 2 or rest or packed_k % 2 or packed_k < k:
        return None
    raw = (ctypes.c_uint16 * (nbytes // 2)).from_address(address)
    values = torch.frombuffer(raw, dtype=torch.int16)  # a view of the packed weight, no copy
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, n, (256,), generator=g)
    cols = torch.randint(0, k, (256,), generator=g)
    where = (
        (rows // _NATIVE_BLOCK) * (packed_k * _NATIVE_BLOCK)
        + (cols // 2) * (2 * _NATIVE_BLOCK)
        + (rows % _NATIVE_BLOCK) * 2
        + cols % 2
    )
    want = weight.detach()[rows, cols].view(torch.int16)
    return packed_k if torch.equal(values[where], want) else None


def packs(dtype: torch.dtype) -> bool:
    """Whether `linear_layer` packs CPU weights of this dtype."""
    return dtype in _PACKABLE and _packing_works(dtype)


def linear_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A linear layer over `weight` [out, in] and `bias`: packed where `pack_linear_layers`
    would pack it, plain otherwise. Gives `F.linear(x, weight, bias)`'s numbers either way."""
    dense = DenseLinear(weight, bias)
    if weight.device.type == "cpu" and packs(weight.dtype):
        return PackedLinear(dense)
    return dense


def pack_linear_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap `model`'s linear layers for packed ones when that is safe; the count swapped."""
    if dtype not in _PACKABLE or not _packing_works(dtype):
        return 0
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == dtype and m.weight.device.type == "cpu"
    ]
    for name, module in linears:
        model.set_submodule(name, PackedLinear(module))
    logger.info("packed %d linear layers for oneDNN", len(linears))
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
