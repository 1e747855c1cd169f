"""Random PEFT LoRA adapters for tiny models, and the reference they are judged against:
greedy tokens of peft's merged model (`merge_and_unload()`), in fp32. Needs `peft` (the
`test` extra)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncengine.testing.reference import greedy_generate

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_peft_adapter(
    base: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    target_modules: Sequence[str] = ALL_MODULES,
    rank: int = 8,
    lora_alpha: int | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    """Save a LoRA adapter of the model in `base` to the folder `path`, with random A and B
    (PEFT starts B at zero, which would change nothing), the way `save_pretrained` writes it.
    `lora_alpha` defaults to twice the rank."""
    model = _peft_model(base, target_modules, rank, lora_alpha, use_rslora, seed, std)
    path = Path(path)
    model.save_pretrained(path, save_embedding_layers=False)  # LoRA tensors only
    return path


def peft_greedy(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str] | None,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy tokens (fp32, EOS ignored) of the base model with the adapter in folder
    `adapter` merged into its weights by peft; of the base model alone for None."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return greedy_generate(model.eval(), prompts, max_new_tokens)


def _peft_model(
    base: str | os.PathLike[str],
    target_modules: Sequence[str],
    rank: int,
    lora_alpha: int | None,
    use_rslora: bool,
    seed: int,
    std: float,
) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if lora_alpha is None else lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations
        peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    return peft_model
