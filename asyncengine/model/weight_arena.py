"""WeightArena: where one model load puts the weights its products read, side by side.

Why (AMD Zen 1, 2 cores, SmolLM2's Q8_0 GGUF file, one stream in process, 2026-11-30): read in
place from the file's mapping (4 KiB pages of the page cache) and from separate heap copies
(the joined projections), a decode step took 13.5-14.2 ms; with every quantized weight copied
into one run of anonymous memory on 2 MiB pages, 11.5-12.2 ms (the same run on 4 KiB pages,
12.2-12.8). The bf16 model's packed panels (NativeDenseLinear, AVX2 CPUs): 15.9-16.6 against
13.1-15.2 ms. Why, we can only guess (no counters in that VM): a layer's weights then lie on few
pages, next to each other, so the step's stream crosses far fewer page boundaries, each a TLB
miss and a restart of the hardware prefetchers (docs/quantization.md, "How it runs").

Slices are 64-byte aligned and taken in order from chunks of CHUNK_BYTES (a weight over a
quarter of that gets a mapping of its own). Each chunk is asked for transparent huge pages
(`quant_cpu.weight_buffer`; plain memory where the system has none or ASYNCENGINE_HUGE_PAGES=0)
and its pages are taken as the copies write them: a chunk's unused tail costs address space
only. The slices keep their chunk alive; the arena itself is dropped after the load.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.quant_cpu import weight_buffer

CHUNK_BYTES = 32 << 20
_ALIGN = 64
# Set to False to compare: `copy` then returns the weight itself (read where it lies: the
# file's mapping, its own allocation).
ENABLED = True


class WeightArena:
    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # uint8, flat
        self._used = 0
        self._made: set[int] = set()  # data_ptr()s of what `empty` gave

    def empty(self, n: int, row_bytes: int) -> torch.Tensor:
        """uint8 [n, row_bytes] in the arena, for a weight written there in its final layout
        (`decode_layout`'s repacks: no second copy); `weight_buffer`'s where the arena is off."""
        if not ENABLED:
            return weight_buffer(n, row_bytes)
        out = self._take(n * row_bytes).view(n, row_bytes)
        self._made.add(out.data_ptr())
        return out

    def keep(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` itself where `empty` gave it, else `copy(weight)`."""
        return weight if weight.data_ptr() in self._made else self.copy(weight)

    def copy(self, weight: torch.Tensor) -> torch.Tensor:
        """A copy of `weight` (contiguous, any dtype) in the arena, of the same shape; `weight`
        itself where the arena is off (ENABLED)."""
        if not ENABLED:
            return weight
        nbytes = weight.numel() * weight.element_size()
        out = self._take(nbytes).view(weight.dtype).view(weight.shape)
        out.copy_(weight)
        return out

    def _take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of fresh uint8, 64-byte aligned."""
        if nbytes > CHUNK_BYTES // 4:
            return _mapping(nbytes)
        start = -(-self._used // _ALIGN) * _ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = _mapping(CHUNK_BYTES), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """Fresh uint8 [nbytes] on huge pages where the system gives them, 2 MiB-aligned there."""
    return weight_buffer(1, nbytes).view(-1)
