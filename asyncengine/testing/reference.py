"""transformers' own greedy decoding: the reference asyncengine's output must equal."""

from __future__ import annotations

import os


def transformers_greedy(
    model_dir: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """`generate(do_sample=False)` in fp32, one prompt at a time (no padding effects), exactly
    `max_new_tokens` new tokens each.

    EOS is ignored the way `ignore_eos` does it: by not stopping, not by suppressing it
    (`min_new_tokens` would mask EOS out of the argmax and so pick a different token).
    """
    from typing import Any

    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=3,
            )
            out.append(ids[0, len(p) :].tolist())
    return out
