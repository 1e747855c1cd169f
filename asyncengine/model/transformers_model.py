"""TransformersModel: a transformers model definition with our paged attention plugged in.

The model comes from `from_pretrained` on the local folder (no hub); each attention layer
calls `attention.py`'s paged attention through transformers' attention interface. After
loading: tensor-parallel sharding, and on CPU the linear layers packed for the native GEMMs
and the native RMSNorm / SiLU-mul kernels swapped in (or, on CUDA, Triton's RMSNorm).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncengine.config import ModelConfig
from asyncengine.errors import UnsupportedModelError
from asyncengine.model import attention
from asyncengine.model.attention import AttentionMetadata
from asyncengine.model.interface import ModelForward, TokenChoice
from asyncengine.model.lora_layers import LoRABatch

logger = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class TransformersModel:
    """A transformers causal LM as a `ModelForward` (see model/interface.py)."""

    token_choice_rows = 0  # always logits

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        # Causality comes from the paged attention's plan. An empty 4D mask is taken as
        # ready-made: transformers then builds none, and skips its packed-sequence check,
        # whose `.all()` reads the GPU back (a host sync each step, and no CUDA graph).
        param = next(model.parameters())
        self._ready_mask = torch.empty((1, 1, 0, 0), dtype=param.dtype, device=param.device)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
        token_choice: TokenChoice | None = None,  # always logits here
        hidden_indices: torch.Tensor | None = None,  # [H]
        hidden_out: list[torch.Tensor] | None = None,
        lora: LoRABatch | None = None,  # never given: adapters run on CpuForward only
    ) -> torch.Tensor:  # [S, V]
        if lora is not None:
            raise ValueError("LoRA adapters run on the lean CPU forward only")
        # transformers takes a batch: ours is one packed sequence, [1, T].
        wants_hidden = hidden_indices is not None and hidden_out is not None
        out = self.module(
            input_ids=input_ids[None],
            attention_mask=self._ready_mask,
            position_ids=positions[None],
            logits_to_keep=logits_indices,
            use_cache=False,
            output_hidden_states=wants_hidden,
            asyncengine_attn=attn,
        )
        if wants_hidden:
            assert hidden_indices is not None and hidden_out is not None
            # the last entry is the final norm's output (AutoModel's last_hidden_state)
            hidden_out.append(out.hidden_states[-1][0].index_select(0, hidden_indices))
        return out.logits[0]  # type: ignore[no-any-return]


def resolve_model_class(model_config: ModelConfig) -> type[torch.nn.Module]:
    """The transformers class for the architecture, or UnsupportedModelError naming it."""
    hide_checkout_kernels()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = model_config.architecture
    supported = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    cls = getattr(transformers, arch, None) if arch in supported else None
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported: asyncengine serves decoder-only causal "
            "language models that transformers defines (e.g. LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    if not getattr(cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported: its attention does not go through "
            "transformers' attention interface, so paged attention cannot be plugged in"
        )
    return cls  # type: ignore[no-any-return]


def load_hf_model(model_config: ModelConfig, device: torch.device) -> torch.nn.Module:
    """Load weights in the configured dtype onto `device`, in eval mode, paged attention on."""
    from transformers.utils import logging as hf_logging

    cls = resolve_model_class(model_config)
    attention.register()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    dtype = getattr(torch, model_config.dtype)
    # Its load report (missing or unexpected weights) is a warning; a missing weight is our
    # error below, said once, in one line.
    verbosity = hf_logging.get_verbosity()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        model, info = cls.from_pretrained(  # type: ignore[attr-defined]
            model_config.model,
            dtype=dtype,
            attn_implementation=attention.ATTN_IMPLEMENTATION,
            device_map=None,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)  # type: ignore[no-untyped-call]
    _check_loaded(model_config.model, info)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model  # type: ignore[no-any-return]


def _check_loaded(folder: str, info: dict[str, Any]) -> None:
    """A weight the checkpoint lacks would be left at its random initial value (transformers
    only prints a load report): refuse the checkpoint instead, naming what is missing."""
    missing = sorted(str(name) for name in info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{folder}: the checkpoint lacks {len(missing)} of the model's weights ({shown}); "
            "copy or download it again"
        )


def hide_checkout_kernels() -> None:
    """Keep a checkout's `kernels/` folder from posing as Hugging Face's `kernels` package.

    From a checkout of this repository (tests, benchmarks) the repository root is on sys.path,
    so the top-level name `kernels` finds our kernels/ folder (asyncengine/kernels is a symlink
    to it: both names' specs resolve to the same files, which is how ours is recognised).
    transformers' `is_kernels_available()`, run when its modelling code is first imported, then
    finds a `kernels` without distribution metadata: it scans every installed distribution for
    one that ships it (about 0.2 s), imports our folder under that name, finds no version and
    answers False. A None in sys.modules is how the import system says "not installed":
    `find_spec` returns None, so transformers gives the same answer at once, and `import kernels`
    raises ImportError instead of handing out our folder under another package's name. Nothing
    else changes: filtering sys.path instead (reverted in 7b28885) broke importlib.metadata
    lookups in the engine core. A no-op where `kernels` is something else, or absent.
    """
    if "kernels" in sys.modules:
        return
    top = importlib.util.find_spec("kernels")
    ours = importlib.util.find_spec("asyncengine.kernels")
    if top is None or ours is None or top.origin is None or ours.origin is None:
        return
    if Path(top.origin).resolve() == Path(ours.origin).resolve():
        sys.modules["kernels"] = None  # type: ignore[assignment]


def load_transformers_forward(
    model_config: ModelConfig,
    device: torch.device,
    native_cpu: bool,
    tp_rank: int = 0,
    tp_world_size: int = 1,
    all_reduce: AllReduce | None = None,
) -> ModelForward:
    """A transformers model loaded on `device`, sharded for tensor parallel, made fast.

    On CPU its linear layers are packed; with the native kernels (`native_cpu`) the lean
    forward takes it where it can (Llama family; same output bits), else the native fused
    norm and MLP kernels are swapped into it. On CUDA with Triton attention, Triton's RMSNorm.
    """
    from asyncengine.model import cpu_forward

    model = load_hf_model(model_config, device)
    if tp_world_size > 1:
        from asyncengine.model.tensor_parallel import shard_model

        assert all_reduce is not None, "tensor parallel needs the group's all-reduce"
        shard_model(model, tp_rank, tp_world_size, all_reduce)
    if device.type == "cpu":
        from asyncengine.model.cpu_linear import pack_linear_layers

        lean = native_cpu and cpu_forward.unsupported_reason(model) is None
        if lean:  # before packing: it joins linear layers
            cpu_forward.join_projections(model)
        # After sharding: the shards are what each rank multiplies by.
        pack_linear_layers(model, getattr(torch, model_config.dtype))
        if lean:
            return cpu_forward.CpuForward.from_model(model)
        if native_cpu:
            from asyncengine.model.fused_ops import use_native_cpu_ops

            use_native_cpu_ops(model)
    elif model_config.attention_backend == "triton":
        from asyncengine.model.fused_ops import use_triton_rms_norm

        # On GPUs the Triton kernels also take the RMSNorms (one pass instead of ~7 ops).
        use_triton_rms_norm(model, device)
    return TransformersModel(model)
