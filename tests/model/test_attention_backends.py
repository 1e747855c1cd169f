"""The Triton attention backend gives the same greedy tokens as the torch backend and as
transformers, through the whole engine: on a GPU (compiled; marked `gpu`) where there is one,
else on the CPU (under Triton's interpreter). See `device` in tests/conftest.py.

One small run covers every attention path: whole prefills, prefill chunks over a cached prefix
(a small token budget splits the longer prompts), decodes next to prefills, and prefix-cache
hits on a second pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.model import attention
from asyncengine.model.attention import AttentionBackend, get_backend
from asyncengine.testing import transformers_greedy

pytest.importorskip("triton")

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(4, 500, (20,), generator=g).tolist()
    tails = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (1, 3, 19)]
    return [[7], shared + tails[0], shared + tails[1], shared + tails[2]]


def _transformers_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(model_dir, prompts, NEW_TOKENS)


def _engine_greedy(model_dir: Path, backend: str, device: str) -> list[list[list[int]]]:
    """Two passes over the prompts (the second hits the prefix cache), token ids of each."""
    llm = LLM(
        model_dir,
        dtype="float32",
        device=device,
        attention_backend=backend,
        max_num_batched_tokens=16,
        num_kv_blocks=24,  # small: the interpreter copies each tensor argument back per launch
    )
    passes = []
    for _ in range(2):
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        passes.append([o.outputs[0].token_ids for o in outs])
    assert llm.statistics().prefix_cache_hits > 0
    return passes


@pytest.mark.timeout(300)
def test_triton_backend_greedy_matches_torch_and_transformers(
    device: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []

    def spy(name: str, device: torch.device) -> AttentionBackend:
        backend = get_backend(name, device)
        used.append(backend.name)
        return backend

    # The engine core runs in this process (LLM): record which backend each step planned with.
    monkeypatch.setattr(attention, "get_backend", spy)
    model_dir = tiny_model_factory("llama")
    expected = _transformers_greedy(model_dir, _prompts())
    torch_passes = _engine_greedy(model_dir, "torch", device)
    assert used and set(used) == {"torch"}
    used.clear()
    triton_passes = _engine_greedy(model_dir, "triton", device)
    assert used and set(used) == {"triton"}
    assert torch_passes == [expected, expected]
    assert triton_passes == [expected, expected]


def test_backend_lookup(device: str) -> None:
    assert get_backend("torch", torch.device(device)).name == "torch"
    assert get_backend("triton", torch.device(device)).name == "triton"
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        get_backend("flash", torch.device(device))
