"""SamplingParams(prompt_logprobs=N): the prompt's own log-probabilities, as vLLM gives them.

Checked against transformers' log-softmax over the same prompt (fp32), through chunked
prefill (16-token steps), with the prefix cache on (a second identical prompt must not take
its blocks from the cache, or its positions would have no logits), for both model paths the
CPU runs (the lean forward and transformers with the torch attention).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, AsyncLLM, SamplingParams
from asyncengine.sampling_params import RequestOutputKind

PROMPT = [5 + (7 * i) % 90 for i in range(41)]
TOP_N = 3


@pytest.fixture(scope="module")
def fp32_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", dtype="float32")


def _reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]  # [P, V]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(prompt_logprobs: Any, reference: torch.Tensor, prompt: list[int]) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, ref = prompt_logprobs[p], reference[p - 1]
        token = prompt[p]
        assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        top = ref.topk(TOP_N).indices.tolist()
        assert set(top) <= set(entry), (p, top, list(entry))
        for rank, token_id in enumerate(top, start=1):
            assert entry[token_id].logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
            if token_id != token:
                assert entry[token_id].rank == rank
        assert entry[token].decoded_token is not None


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
@pytest.mark.timeout(120)
def test_prompt_logprobs_equal_transformers_through_chunks_and_the_prefix_cache(
    fp32_llama: Path, attention_backend: str
) -> None:
    reference = _reference(fp32_llama, PROMPT)
    llm = LLM(
        fp32_llama,
        device="cpu",
        dtype="float32",
        attention_backend=attention_backend,
        max_num_batched_tokens=16,
        block_size=16,
        enable_prefix_caching=True,
    )
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP_N
        )
        plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        first = llm.generate([PROMPT], params, use_tqdm=False)[0]
        # The same prompt again, beside one without prompt logprobs that does use the cache,
        # and one with n=2 (its prompt logprobs are computed once).
        again, without, two = llm.generate(
            [PROMPT, PROMPT, PROMPT],
            [params, plain, SamplingParams(temperature=0.0, max_tokens=4, n=2, prompt_logprobs=1)],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    _check(first.prompt_logprobs, reference, PROMPT)
    _check(again.prompt_logprobs, reference, PROMPT)
    assert without.prompt_logprobs is None
    assert two.prompt_logprobs is not None and len(two.prompt_logprobs) == len(PROMPT)
    # Generation itself is unchanged by asking for them.
    assert first.outputs[0].token_ids == without.outputs[0].token_ids


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_streamed_request_gets_its_prompt_logprobs_in_the_first_delta(
    fp32_llama: Path,
) -> None:
    reference = _reference(fp32_llama, PROMPT)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        ignore_eos=True,
        prompt_logprobs=TOP_N,
        output_kind=RequestOutputKind.DELTA,
    )
    async with AsyncLLM.from_pretrained(
        fp32_llama, device="cpu", dtype="float32", max_num_batched_tokens=16
    ) as engine:
        outs = [out async for out in engine.generate(PROMPT, params)]
    _check(outs[0].prompt_logprobs, reference, PROMPT)
    assert all(out.prompt_logprobs is None for out in outs[1:])
    assert sum(len(out.outputs[0].token_ids) for out in outs) == 5


def test_prompt_logprobs_out_of_range_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
