"""Load a decoder-only transformers model from a local folder, with paged attention plugged in."""

from __future__ import annotations

import logging

import torch

from asyncengine.config import ModelConfig
from asyncengine.errors import UnsupportedModelError
from asyncengine.model import attention

logger = logging.getLogger(__name__)


def resolve_model_class(model_config: ModelConfig) -> type[torch.nn.Module]:
    """The transformers class for the architecture, or UnsupportedModelError naming it."""
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


def load_model(model_config: ModelConfig, device: torch.device) -> torch.nn.Module:
    """Load weights in the configured dtype onto `device`, in eval mode, paged attention on."""
    from transformers.utils import logging as hf_logging

    cls = resolve_model_class(model_config)
    attention.register()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    dtype = getattr(torch, model_config.dtype)
    model = cls.from_pretrained(  # type: ignore[attr-defined]
        model_config.model,
        dtype=dtype,
        attn_implementation=attention.ATTN_IMPLEMENTATION,
        device_map=None,
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model  # type: ignore[no-any-return]
