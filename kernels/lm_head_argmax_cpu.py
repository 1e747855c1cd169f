"""Greedy (or Gumbel-max sampled) next tokens without the lm_head's logits
(`csrc/lm_head_argmax.c`).

At one to a few rows the lm_head is a matrix-vector product bound by memory, and on small
models a large share of a decode step: 57 of SmolLM2-135M's 270 MB a token, 272 of
Qwen2.5-0.5B's ~1,000. Greedy sampling wants one index per row. `LmHeadArgmax` keeps an int8
copy of the weight (per-row scale, half the bf16 bytes) with a bound on each row's rounding
error; a call reads the copy, bounds every logit, and computes exactly (with the product's
own kernel and rounding) only the 64-column blocks that may hold the maximum: the result is
the index `argmax(lm_head(hidden)[:, :vocab])` gives, bit for bit, never an estimate. Rows
sampled at a temperature T with the sampler's Gumbel noise g (`Sampler.gumbel_noise`) work the
same way on the scores logits / T + g.

The price is the copy's memory (vocab x hidden bytes) and building it at load
(`ae_lm_head_quantize`, from the packed weight: 0.23 s for a 152k vocabulary).
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import NativeKernels, require_native
from asyncengine.kernels.linear_cpu import NATIVE_BLOCK, LinearCpu

# The most rows a call screens: more rows make the product compute-bound, where the int8
# copy's widening costs more than the bf16 dot products it replaces.
ARGMAX_MAX_ROWS = 8


class LmHeadArgmax:
    """`(hidden [rows, K] bf16, vocab) -> [rows] int64`: argmax over each row's first `vocab`
    logits of the lm_head `linear`, first index on ties; None where a row's logits could not
    be bounded (NaN or infinite values): the caller then computes the logits."""

    def __init__(self, linear: LinearCpu) -> None:
        self._lib: NativeKernels = require_native()
        self._linear = linear
        n, k = linear.shape
        num_blocks = -(-n // NATIVE_BLOCK)
        self.q = torch.empty(num_blocks, k, NATIVE_BLOCK, dtype=torch.int8)  # [B, K, 64]
        self.scale = torch.empty(num_blocks * NATIVE_BLOCK, dtype=torch.float32)
        self.rnorm = torch.empty(num_blocks * NATIVE_BLOCK, dtype=torch.float32)
        self._lib.lm_head_quantize(
            linear.address, n, k, linear.packed_k, self.q.data_ptr(), self.scale.data_ptr(),
            self.rnorm.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        self._n, self._k = n, k
        self.exact_blocks = 0  # the last call's blocks computed exactly (over its rows)

    def __call__(
        self,
        hidden: torch.Tensor,  # [rows, K] bf16
        vocab: int,
        temperatures: torch.Tensor | None = None,  # [rows] float32: 0 greedy, else T
        noise: torch.Tensor | None = None,  # [rows, >= vocab] float32 Gumbel noise
    ) -> torch.Tensor | None:
        """Each row's token: argmax of its first `vocab` logits; with `temperatures` and
        `noise`, a row with T > 0 takes argmax(logits / T + noise) instead (fp32, the
        sampler's Gumbel-max), bit for bit the sampler's choice over the same noise."""
        rows, k = hidden.shape
        if k != self._k or hidden.dtype != torch.bfloat16 or not 0 < vocab <= self._n:
            raise ValueError(
                f"LmHeadArgmax takes bf16 rows of {self._k} values and 0 < vocab <= "
                f"{self._n}, not {tuple(hidden.shape)} {hidden.dtype}, vocab {vocab}"
            )
        temps_address = noise_address = noise_stride = 0
        if temperatures is not None and noise is not None:
            if (
                temperatures.shape != (rows,)
                or temperatures.dtype != torch.float32
                or noise.dtype != torch.float32
                or noise.dim() != 2
                or noise.shape[0] != rows
                or noise.shape[1] < vocab
                or noise.stride(1) != 1
            ):
                raise ValueError(
                    f"LmHeadArgmax takes float32 temperatures [{rows}] and noise [{rows}, >= "
                    f"{vocab}] (rows of unit stride), not {tuple(temperatures.shape)} "
                    f"{temperatures.dtype} and {tuple(noise.shape)} {noise.dtype}"
                )
            temperatures = temperatures.contiguous()
            temps_address, noise_address = temperatures.data_ptr(), noise.data_ptr()
            noise_stride = noise.stride(0)
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self.exact_blocks = self._lib.lm_head_argmax_bf16(
            hidden.data_ptr(), hidden.stride(0), rows, self.q.data_ptr(),
            self.scale.data_ptr(), self.rnorm.data_ptr(), self._linear.address, k,
            self._linear.packed_k, self._linear.bias_address, vocab, temps_address, noise_address,
            noise_stride, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rows and int(out.min()) < 0:
            return None
        return out
