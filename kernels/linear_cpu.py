"""Decode-sized bf16 linear layers on CPU over oneDNN's packed weights: the native kernels
(`csrc/linear.c`), with two variants fused with what follows the product.

`asyncengine/model/cpu_linear.py`'s `PackedLinear` reorders each weight into oneDNN's blocked
layout once; `prepare_linear_cpu` checks that the packed weight lies as the kernels read it,
[ceil(out / 64)][in_padded / 2][64][2], and returns a `LinearCpu` over it. Where oneDNN chose
another layout (on CPUs with AMX it packs for its tile kernels), the kernels get a copy of the
weight in their own layout (`pack_native`): twice the weight memory, for their decode speed.

- `LinearCpu(x)`: `x @ weight.T + bias` with AVX512-BF16 dot products: one-row products at
  close to the memory bandwidth (oneDNN's reach about half of it and pay more per call). Its
  sums run in another order than oneDNN's, so a value may differ in the last bit (about one in
  50,000 on SmolLM2's shapes).
- `LinearCpu.silu_mul(x)`: a joint [gate; up] product ending in `silu(gate) * up`, bit for bit
  `silu_mul_cpu` of the product's halves, without the [rows, 2I] intermediate.
- `LinearCpu.add_rms_norm(x, residual, weight, eps)`: the product, then `residual += product`
  and its RMSNorm in the same thread team, bit for bit `rms_norm_cpu(product, weight, eps,
  residual)`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from asyncengine.kernels.cpu_native import NativeKernels, load_native, require_native

logger = logging.getLogger(__name__)

NATIVE_BLOCK = 64  # output columns per block of the packed layout the kernels read


class LinearCpu:
    """x [rows, in] -> x @ weight.T + bias by the native kernels over oneDNN's packed weight."""

    def __init__(self, lib: NativeKernels, packed: torch.Tensor, packed_k: int,
                 shape: tuple[int, int], bias: torch.Tensor | None) -> None:  # fmt: skip
        self._lib = lib
        self._packed = packed  # the kernels read its memory: keep it alive
        # a copy of the weight of its own (oneDNN packed in another layout: AMX), not oneDNN's
        self.own_copy = not packed.is_mkldnn
        self._address = address_of(packed)
        self._packed_k = packed_k
        self._n, self._k = shape
        self._bias = None if bias is None else bias.detach().contiguous()
        self._bias_address = None if self._bias is None else self._bias.data_ptr()
        self._blocks: torch.Tensor | None = None  # rows()'s view of the packed weight

    @property
    def address(self) -> int:
        """The packed weight's address, for native callers (decode_layers.c)."""
        return self._address

    @property
    def packed_k(self) -> int:
        """The packed weight's input extent (in_features rounded up as it was packed)."""
        return self._packed_k

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self._n, self._k

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, in] bf16
        """Rows `ids` of the weight, gathered from the packed layout (a tied embedding's
        lookup, without a plain copy of the weight): the same values, a new tensor."""
        if self._blocks is None:  # a view of the packed memory (this object keeps it alive)
            count = -(-self._n // NATIVE_BLOCK) * self._packed_k * NATIVE_BLOCK
            raw = (ctypes.c_uint16 * count).from_address(self._address)
            flat = torch.frombuffer(raw, dtype=torch.bfloat16)
            self._blocks = flat.view(-1, self._packed_k // 2, NATIVE_BLOCK, 2)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self._n:
            raise IndexError(f"row ids must lie in [0, {self._n})")
        picked = self._blocks[ids // NATIVE_BLOCK, :, ids % NATIVE_BLOCK, :]  # [T, in/2, 2]
        return picked.reshape(ids.shape[0], self._packed_k)[:, : self._k].contiguous()

    @property
    def bias_address(self) -> int:
        """The bias's address; 0 where there is none."""
        return self._bias_address or 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self._n, dtype=torch.bfloat16)
        self._lib.linear_bf16(
            x.data_ptr(), x.stride(0), x.shape[0], self._address, self._n, self._k,
            self._packed_k, self._bias_address, out.data_ptr(), self._n, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [rows, in]
        residual: torch.Tensor,  # [rows, out], rows of unit stride, updated in place
        weight: torch.Tensor,  # [out] the norm's weight, bf16
        eps: float,
    ) -> torch.Tensor:  # [rows, out]
        """residual += the product, in place; its RMSNorm times weight, as a new tensor."""
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

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out / 2]
        """silu(g) * u for this [gate; up] product's halves (out a multiple of 128)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        inter = self._n // 2
        out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
        self._lib.linear_silu_bf16(
            x.data_ptr(), x.stride(0), x.shape[0], self._address, self._n, self._k,
            self._packed_k, self._bias_address, out.data_ptr(), inter, torch.get_num_threads(),
        )  # fmt: skip
        return out


def prepare_linear_cpu(
    weight: torch.Tensor,  # [out, in] the plain weight
    bias: torch.Tensor | None,  # [out]
    packed: torch.Tensor,  # oneDNN's reordering of weight (torch.ops.mkldnn)
) -> LinearCpu | None:
    """The native kernels' product over `packed`, or over a copy of `weight` in their layout
    where oneDNN packed it in another; None where they do not apply (not bf16, not built with
    AVX512-BF16)."""
    if weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    lib = load_native()
    if lib is None or not lib.linear_bf16_fast:
        return None
    packed, packed_k = native_layout(weight, packed)
    n, k = weight.shape
    return LinearCpu(lib, packed, packed_k, (n, k), bias)


def native_layout(weight: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What the native kernels read for `weight`, and its padded input extent: oneDNN's
    `packed` where it lies in their layout, else a copy of their own (`pack_native`)."""
    packed_k = _packed_k(weight, packed)
    if packed_k is not None:
        return packed, packed_k
    logger.debug("oneDNN packed a %s weight in another layout: the native kernels get a copy",
                 tuple(weight.shape))  # fmt: skip
    return pack_native(weight)


def address_of(packed: torch.Tensor) -> int:
    """The address of a packed weight's data, oneDNN's (opaque) or a plain tensor's."""
    return int(torch.ops.mkldnn.data_ptr(packed) if packed.is_mkldnn else packed.data_ptr())


def pack_native(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`weight` [out, in] bf16 in the native kernels' layout, [ceil(out / 64)][in_padded / 2]
    [64][2] with zero padding (a new plain tensor), and in_padded (in, rounded up to even)."""
    n, k = weight.shape
    blocks, packed_k = -(-n // NATIVE_BLOCK), k + k % 2
    padded = weight.detach().new_zeros(blocks * NATIVE_BLOCK, packed_k)
    padded[:n, :k] = weight.detach()
    # [blocks, 64, K/2, 2] -> [blocks, K/2, 64, 2]
    by_pair = padded.view(blocks, NATIVE_BLOCK, packed_k // 2, 2).transpose(1, 2)
    return by_pair.contiguous(), packed_k


def _packed_k(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The padded input extent of `packed` if it holds `weight` as the native kernel reads it,
    [ceil(out / 64)][in_padded / 2][64][2]: checked on the sizes and on a sample of values."""
    n, k = weight.shape
    blocks = -(-n // NATIVE_BLOCK)
    try:
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (RuntimeError, AttributeError):  # a torch without these accessors
        return None
    packed_k, rest = divmod(nbytes // 2, blocks * NATIVE_BLOCK)
    if nbytes % 2 or rest or packed_k % 2 or packed_k < k:
        return None
    raw = (ctypes.c_uint16 * (nbytes // 2)).from_address(address)
    values = torch.frombuffer(raw, dtype=torch.int16)  # a view of the packed weight, no copy
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, n, (256,), generator=g)
    cols = torch.randint(0, k, (256,), generator=g)
    where = (
        (rows // NATIVE_BLOCK) * (packed_k * NATIVE_BLOCK)
        + (cols // 2) * (2 * NATIVE_BLOCK)
        + (rows % NATIVE_BLOCK) * 2
        + cols % 2
    )
    want = weight.detach()[rows, cols].view(torch.int16)
    return packed_k if torch.equal(values[where], want) else None


def quiesce_pool(timeout_ms: int = 1000) -> None:
    """Wait until no work-pool helper is inside an item (csrc/pool.c: one preempted inside an
    item may run on after its call returned, reading the call's inputs), where the native
    library is loaded: before freeing memory that products read (weights at shutdown, tests'
    tensors)."""
    if load_native.cache_info().currsize == 0:
        return  # never loaded in this process: no helper exists
    lib = load_native()
    if lib is not None:
        lib.pool_quiesce(timeout_ms)


# The most rows a product (or tokens a step's attention) runs on the work pool with: csrc/pool.h's
# AE_POOL_MAX_ROWS; larger ones run on OpenMP.
POOL_MAX_ROWS = 8


@contextmanager
def openmp_in_caller() -> Iterator[None]:
    """Inside, this thread's OpenMP regions (torch's elementwise ops and reductions over large
    tensors, the kernels' own) run in the thread alone; other threads keep their setting.

    For the host work around a step whose products run on the work pool (sampling a few rows of
    logits, drawing their noise): after an OpenMP region ends its team's idle thread spins for
    milliseconds, on the core that the pool's helper needs for the next products (on 2 cores, a
    1B model's decode step ran 3 ms slower after one such region), while a few rows' ops take
    about as long in one thread as in two. Nothing changes where the native library is not
    loaded."""
    lib = load_native() if load_native.cache_info().currsize else None
    if lib is None:
        yield
        return
    before = lib.omp_set_threads(1)
    try:
        yield
    finally:
        lib.omp_set_threads(before)


def set_pool_strict(on: bool) -> bool:
    """Tests: with `on`, every work-pool job waits for its helpers to leave its items before
    it returns, so its caller may free what it read at once (initially
    $ASYNCENGINE_POOL_STRICT=1, which the test suite sets); the previous setting."""
    return bool(require_native().pool_set_strict(int(on)))


def delay_pool_helpers(ns: int) -> int:
    """For tests: from now on the kernels' pool helpers (csrc/pool.c) sleep `ns` nanoseconds
    after claiming an item, as a preempted thread would (0: not at all). Returns how many items
    the callers took over from helpers since the last call."""
    return int(require_native().pool_test_delay_helpers(ns))
