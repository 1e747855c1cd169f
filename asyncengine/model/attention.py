"""asyncengine's paged attention, plugged into transformers' attention interface.

The model runner passes an `AttentionMetadata` to the model's forward as the keyword argument
`asyncengine_attn`; transformers hands every keyword argument on to the attention function of
each layer, which writes the layer's new K/V into the paged cache and attends over it.

Three backends implement the same three steps (plan once per step; per layer, write the cache
and attend): "cpu" (native C kernels built on first use, CPU's default), "torch" (the reference,
and the CPU fallback where no C compiler works) and "triton" (the kernels, CUDA's default; on
CPU they run under Triton's interpreter, for tests). `ModelConfig.attention_backend` picks one.
A backend may lay the cache out its own way ("cpu" stores key blocks transposed), so one
backend writes and reads a cache for its whole life.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.kernels.paged_attention import paged_attention_torch, plan_paged_attention_torch
from asyncengine.kernels.reshape_and_cache import reshape_and_cache_torch

ATTN_IMPLEMENTATION = "asyncengine_paged"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One implementation of paged attention; the kernels share their signatures.

    - `plan(query_start_loc, seq_lens, block_table, block_size, dtype)`: once per step, from
      host lists; returns the backend's plan, shared by every layer.
    - `reshape_and_cache(key, value, kv_cache, slot_mapping)`: per layer, in place.
    - `paged_attention(query, key, value, kv_cache, plan, scale)`: per layer; `[T, H_q, D]`.
    """

    name: str
    plan: Callable[..., Any]
    reshape_and_cache: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    paged_attention: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend(
    "torch", plan_paged_attention_torch, reshape_and_cache_torch, paged_attention_torch
)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend named by a resolved `attention_backend` ("cpu" | "torch" | "triton").

    "cpu" needs a CPU device; where its native kernels can't be built (no C compiler, or
    ASYNCENGINE_NATIVE_KERNELS=0) it is the torch reference, after one logged warning.
    "triton" on a CPU device turns Triton's interpreter on (TRITON_INTERPRET=1) for this
    process before the kernels are imported. Raises RuntimeError when triton is missing or the
    kernels were already imported in the other mode.
    """
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"attention_backend='cpu' runs on CPU devices only, not {device.type!r}: "
                "choose 'auto', 'torch' or 'triton'"
            )
        return _cpu_backend()
    if name == "triton":
        return _triton_backend(device.type)
    raise ValueError(f"attention_backend={name!r}: expected 'cpu', 'torch' or 'triton'")


@functools.cache
def _cpu_backend() -> AttentionBackend:
    from asyncengine.kernels.cpu_native import load_native

    if load_native() is None:
        return TORCH_BACKEND
    from asyncengine.kernels.paged_attention_cpu import (
        paged_attention_cpu,
        plan_paged_attention_cpu,
    )
    from asyncengine.kernels.reshape_and_cache_cpu import reshape_and_cache_cpu

    return AttentionBackend(
        "cpu", plan_paged_attention_cpu, reshape_and_cache_cpu, paged_attention_cpu
    )


@functools.cache
def _triton_backend(device_type: str) -> AttentionBackend:
    if device_type == "cpu":
        # `@triton.jit` reads this when it decorates, i.e. when the kernel modules are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from asyncengine.kernels.paged_attention_triton import (
            paged_attention_triton,
            plan_paged_attention_triton,
        )
        from asyncengine.kernels.reshape_and_cache_triton import reshape_and_cache_triton
        from asyncengine.kernels.triton_utils import INTERPRETING
    except ImportError as e:
        raise RuntimeError(
            "attention_backend='triton' needs the triton package: "
            "pip install 'triton>=3.2' (the `triton` extra), or choose attention_backend='torch'"
        ) from e
    if (device_type == "cpu") != INTERPRETING:
        mode = "under the interpreter" if INTERPRETING else "compiled"
        raise RuntimeError(
            f"attention_backend='triton' on a {device_type!r} device, but this process imported "
            f"the Triton kernels {mode} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
            ": the interpreter runs only CPU tensors, compiled kernels only GPU ones"
        )
    return AttentionBackend(
        "triton", plan_paged_attention_triton, reshape_and_cache_triton, paged_attention_triton
    )


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged cache, for every layer alike."""

    kv_caches: list[torch.Tensor]  # per layer [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor  # [T] int64
    plan: Any  # the backend's batch layout, planned once per step for every layer
    backend: AttentionBackend = TORCH_BACKEND

    @classmethod
    def build(
        cls,
        kv_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,  # [T]
        query_start_loc: list[int],  # B + 1 offsets into the packed tokens
        seq_lens: list[int],  # [B] tokens in the cache after this step
        block_table: torch.Tensor,  # [B, max_blocks]
        block_size: int,
        dtype: torch.dtype,
        backend: str = "torch",  # resolved ModelConfig.attention_backend
    ) -> AttentionMetadata:
        impl = get_backend(backend, block_table.device)
        plan = impl.plan(query_start_loc, seq_lens, block_table, block_size, dtype)
        return cls(kv_caches=kv_caches, slot_mapping=slot_mapping, plan=plan, backend=impl)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H_q, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns ([1, T, H_q, D], no weights)."""
    meta: AttentionMetadata = kwargs["asyncengine_attn"]
    kv_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    q = query[0].transpose(0, 1)  # [T, H_q, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)
    meta.backend.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = meta.backend.paged_attention(q, k, v, kv_cache, meta.plan, scale)  # [T, H_q, D]
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Causality comes from the packed metadata; a dense [T, T] mask would be wasted work.
    return None


def register() -> None:
    """Register the attention function and its (absent) mask under ATTN_IMPLEMENTATION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
