"""Which model implementation runs a config, chosen once, and loading it.

`choose_model` is the one place that decides between the two `ModelForward`s: the lean CPU
forward built straight from the checkpoint (no transformers in the process), or a
transformers model (which, on CPU, may still run through the lean forward once loaded; see
`transformers_model.load_transformers_forward`). Start-up (`import_model_code`) and loading
(`load_model_forward`) both follow it.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncengine.config import ModelConfig
from asyncengine.gguf.serving import is_gguf_file
from asyncengine.model.interface import ModelForward

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What runs a model config. `native_cpu`: the native CPU kernels are built and the
    attention backend is "cpu" (the only way either lean path or the fused ops run)."""

    lean_checkpoint: bool  # CpuForward straight from the safetensors files
    native_cpu: bool
    reason: str | None  # why not the lean checkpoint path


def choose_model(model_config: ModelConfig, *, tensor_parallel: bool = False) -> ModelChoice:
    """The implementation for `model_config`: decided here and nowhere else."""
    native = model_config.attention_backend == "cpu" and _native_kernels_available()
    if tensor_parallel:
        reason: str | None = "tensor parallel shards a transformers model"
    elif model_config.attention_backend != "cpu":
        reason = f"attention backend {model_config.attention_backend!r}, not 'cpu'"
    elif not native:
        reason = "the native CPU kernels are unavailable"
    else:
        # Imported here: import_model_code imports it with the GC paused.
        from asyncengine.model import cpu_checkpoint

        reason = cpu_checkpoint.lean_checkpoint_reason(model_config)
    if reason is not None and is_gguf_file(model_config.model):
        raise ValueError(
            f"{model_config.model}: a GGUF file runs on the lean CPU forward only (device "
            f"'cpu', attention backend 'cpu', no tensor parallel, the native CPU kernels), "
            f"which cannot run it here: {reason}"
        )
    if reason is not None and model_config.quantization is not None:
        raise ValueError(
            f"quantization={model_config.quantization!r} runs on the lean CPU forward only "
            f"(Llama, Mistral, Qwen2 and Qwen3 safetensors checkpoints, device 'cpu', the "
            f"native CPU kernels), which cannot run {model_config.model}: {reason}"
        )
    return ModelChoice(reason is None, native, reason)


def load_model_forward(
    model_config: ModelConfig,
    device: torch.device,
    tp_rank: int = 0,
    tp_world_size: int = 1,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ModelForward:
    """Load the model `choose_model` picks, on `device` (this rank's shard under TP)."""
    choice = choose_model(model_config, tensor_parallel=tp_world_size > 1)
    if choice.lean_checkpoint:
        from asyncengine.model import cpu_checkpoint

        # Straight from the checkpoint: transformers is never imported.
        return cpu_checkpoint.load_cpu_forward(model_config)
    logger.info("loading through transformers: %s", choice.reason)
    from asyncengine.model.transformers_model import load_transformers_forward

    return load_transformers_forward(
        model_config, device, choice.native_cpu, tp_rank, tp_world_size, all_reduce
    )


def _native_kernels_available() -> bool:
    from asyncengine.kernels.cpu_native import load_native

    return load_native() is not None


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
    if choose_model(model_config, tensor_parallel=tensor_parallel).lean_checkpoint:
        return  # torch and the lean loader only, imported by choose_model
    from asyncengine.model.transformers_model import resolve_model_class

    resolve_model_class(model_config)
