"""Load a decoder-only transformers model from a local folder, with paged attention plugged in."""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys
from pathlib import Path

import torch

from asyncengine.config import ModelConfig
from asyncengine.errors import UnsupportedModelError
from asyncengine.model import attention

logger = logging.getLogger(__name__)


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


def import_model_code(
    model_config: ModelConfig, *, freeze: bool, tensor_parallel: bool = False
) -> None:
    """Import what loading `model_config` will run in this process, with the cyclic GC paused.

    That is torch and the lean CPU loader where it takes the checkpoint (see
    `cpu_checkpoint.lean_checkpoint_reason`; never with `tensor_parallel`), and otherwise
    transformers' model code too (`resolve_model_class`).

    Importing transformers' modelling code makes about 600,000 objects that live as long as
    the process (torch alone about 150,000). Left on, the cyclic GC walks the growing heap
    again and again while they are made: about 0.6 s of the 2.7 s the imports take on the
    2-core benchmark machine. Paused, the heap is walked once at most. Afterwards:

    - `freeze=True`, for processes the engine owns: the objects move to the permanent
      generation and are never walked again, neither now nor by a later full collection. The
      imports' cyclic leftovers (about 13,000 objects, some 9 MB of resident memory) are never
      freed; collecting them first would cost another 0.2-0.3 s.
    - `freeze=False`, in an application's process (core="thread", LLM): one full collection
      (0.2-0.3 s), as freezing would pin the application's own objects too, and its extension
      modules would report them as leaks at exit.

    Call it before the weights load: they load with the GC on, so a cycle holding a tensor is
    still freed. Raises UnsupportedModelError for an architecture we cannot serve.
    """
    if "transformers.modeling_utils" in sys.modules:
        # Imported before (an earlier engine in this process): what is left to import is
        # small, and a full collection of an application's heap would cost more than it saves.
        _import_for(model_config, tensor_parallel)
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        _import_for(model_config, tensor_parallel)
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            if not freeze:
                gc.collect()
            gc.enable()


def _import_for(model_config: ModelConfig, tensor_parallel: bool) -> None:
    if not tensor_parallel and model_config.attention_backend == "cpu":
        from asyncengine.model.cpu_checkpoint import lean_checkpoint_reason

        if lean_checkpoint_reason(model_config) is None:
            return
    resolve_model_class(model_config)


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
