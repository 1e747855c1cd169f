"""Rotary position tables for Llama-family checkpoints, read from config.json without transformers.

The lean CPU loader (`cpu_checkpoint.py`) builds models without importing transformers' model
code, so it computes the rotary tables itself. It must compute them exactly as transformers
does, because the engine promises the same numbers either way. So every formula below repeats
transformers' own op for op: `LlamaRotaryEmbedding.forward`, and the "default", "linear" and
"llama3" inverse-frequency functions of `modeling_rope_utils`. Qwen2, Qwen3 and Mistral share
them. tests/model/test_cpu_checkpoint.py checks the tables against transformers' bit for bit.
Any other rope type (dynamic, yarn, longrope, ...) is refused here, and such a model loads
through transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The rope settings of a config.json, resolved as transformers resolves them."""

    rope_type: str
    theta: float
    head_dim: int
    params: dict[str, Any]  # the rope parameter dict (factor, low_freq_factor, ...)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], head_dim: int) -> RopeSpec:
        """ValueError naming the setting when the rope is not one computed here."""
        # transformers' priority: rope_scaling (legacy), else rope_parameters; theta from
        # that dict, else the top-level rope_theta, else the default.
        params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope parameters")
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})")
        if "partial_rotary_factor" in params or "partial_rotary_factor" in hf:
            raise ValueError("a partial_rotary_factor")
        theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_THETA))
        if rope_type == "llama3":
            # The top-level value wins over the dict's, as in standardize_rope_params.
            if "original_max_position_embeddings" in hf:
                params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            else:
                params.setdefault(
                    "original_max_position_embeddings", hf.get("max_position_embeddings")
                )
        needed = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(rope_type, ())
        missing = [k for k in needed if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_type {rope_type!r} without {', '.join(missing)}")
        return cls(rope_type=rope_type, theta=float(theta), head_dim=head_dim, params=params)

    def inv_freq(self) -> torch.Tensor:
        """[head_dim / 2] float32 inverse frequencies."""
        dim = self.head_dim
        base = self.theta
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
        )
        if self.rope_type == "linear":
            inv_freq /= self.params["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, self.params)
        return inv_freq


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency smoothing; the same ops in the same order as transformers'."""
    factor = p["factor"]
    low_freq_factor = p["low_freq_factor"]
    high_freq_factor = p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# RotaryEmbedding.rows' tables: the first one's rows, and the most (32,768 positions of a
# 128-wide head are 32 MB for cos and sin together in fp32, 16 MB in bf16).
TABLE_MIN_ROWS = 4096
TABLE_MAX_ROWS = 32768


class RotaryEmbedding:
    """`(x, position_ids [B, T]) -> (cos, sin)`, each [B, T, head_dim] in x's dtype.

    The same call and the same numbers as transformers' `LlamaRotaryEmbedding` (the three
    rope types here all have an attention scaling of 1). `freq_factors` [head_dim / 2] divide
    the inverse frequencies, as llama.cpp applies a GGUF file's `rope_freqs` tensor (how its
    converter stores Llama 3.1-style scaling).
    """

    def __init__(self, spec: RopeSpec, freq_factors: torch.Tensor | None = None) -> None:
        self.inv_freq = spec.inv_freq()
        if freq_factors is not None:
            self.inv_freq = self.inv_freq / freq_factors.float()
        self.attention_scaling = 1.0
        # cos and sin of positions 0 .. len - 1 by dtype, [len, head_dim] each: see `rows`
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for `positions` [T] (CPU): rows of tables made by
        `__call__` for positions 0 .. n - 1, so the same numbers (each value is computed on
        its own), in two lookups instead of `__call__`'s nine ops (~0.1 ms of a one-stream
        decode step of a small model). A table grows to twice the highest position asked, up
        to TABLE_MAX_ROWS; a step past that computes its rows as `__call__` does."""
        top = int(positions.max()) if positions.numel() else 0
        if top >= TABLE_MAX_ROWS:
            cos, sin = self(torch.empty(0, dtype=dtype), positions[None])
            return cos[0], sin[0]
        table = self._tables.get(dtype)
        if table is None or top >= table[0].shape[0]:
            size = min(TABLE_MAX_ROWS, max(TABLE_MIN_ROWS, 2 * (top + 1)))
            cos, sin = self(torch.empty(0, dtype=dtype), torch.arange(size)[None])
            table = self._tables[dtype] = (cos[0], sin[0])
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(
            device=x.device, dtype=torch.float
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
