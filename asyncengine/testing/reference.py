"""transformers' own greedy decoding: the reference asyncengine's output must equal."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncengine.sampling_params import SamplingParams


def transformers_greedy(
    model_dir: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """`generate(do_sample=False)` in fp32, one prompt at a time (no padding effects), exactly
    `max_new_tokens` new tokens each.

    EOS is ignored the way `ignore_eos` does it: by not stopping, not by suppressing it
    (`min_new_tokens` would mask EOS out of the argmax and so pick a different token).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_generate(model.eval(), prompts, max_new_tokens)


def greedy_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A loaded transformers model's `generate(do_sample=False)`, one prompt at a time,
    exactly `max_new_tokens` new tokens each (EOS ignored as `transformers_greedy` says)."""
    import torch

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


def engine_tokens_and_logprobs(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    passes: int = 1,
    device: str = "cpu",
    **engine_config: object,
) -> list[tuple[list[int], list[list[float]]]]:
    """Each completion's tokens and its per-step logprobs (sorted), from a fresh offline
    engine over `model_dir` on `device` (the CPU unless told: the same on any machine) that
    runs `prompts` `passes` times: what tests compare to the bit between two ways of running
    one checkpoint. `params` must ask for logprobs."""
    from asyncengine import LLM

    llm = LLM(model_dir, device=device, **engine_config)
    try:
        results = []
        for _ in range(passes):
            for out in llm.generate(prompts, params, use_tqdm=False):
                completion = out.outputs[0]
                assert completion.logprobs is not None, "ask for logprobs"
                lps = [sorted(v.logprob for v in step.values()) for step in completion.logprobs]
                results.append((list(completion.token_ids), lps))
        return results
    finally:
        llm.shutdown()
