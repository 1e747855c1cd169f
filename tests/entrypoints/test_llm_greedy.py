"""Greedy output equals transformers' generate(do_sample=False), token for token.

Four architectures; mixed prompt lengths (1 to 200 tokens); then the same with prefix-cache
hits, with chunked prefill, and with preemption forced by a small KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.testing import transformers_greedy

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _mixed_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [1, 7, 16, 33, 64, 100, 150, 200]
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _shared_prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(4, 500, (48,), generator=g).tolist()
    suffixes = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (1, 5, 16, 23, 40)]
    return [prefix + s for s in suffixes] + [prefix[:32], prefix + suffixes[2]]


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(model_dir, prompts, NEW_TOKENS)


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> tuple[Path, dict[str, list[list[int]]]]:
    model_dir = tiny_model_factory(request.param)
    return model_dir, {
        "mixed": _reference(model_dir, _mixed_prompts()),
        "shared": _reference(model_dir, _shared_prefix_prompts()),
    }


def _generate(
    model_dir: Path, prompts: list[list[int]], **config: object
) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, device="cpu", dtype="float32", **config)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _assert_free(llm: LLM) -> None:
    stats = llm.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


@pytest.mark.timeout(600)
def test_greedy_matches_transformers(arch_case: tuple[Path, dict[str, list[list[int]]]]) -> None:
    model_dir, ref = arch_case
    got, llm = _generate(model_dir, _mixed_prompts())
    assert got == ref["mixed"]
    _assert_free(llm)


@pytest.mark.timeout(600)
def test_greedy_matches_with_prefix_cache_hits(
    arch_case: tuple[Path, dict[str, list[list[int]]]],
) -> None:
    model_dir, ref = arch_case
    llm = LLM(model_dir, device="cpu", dtype="float32")
    prompts = _shared_prefix_prompts()
    # The first pass fills the cache; the second is served from it.
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref["shared"]
    stats = llm.statistics()
    assert stats.prefix_cache_hits > 0
    assert all(o.metrics is not None and o.metrics.num_cached_tokens >= 16 for o in outs)
    _assert_free(llm)


@pytest.mark.timeout(600)
def test_greedy_matches_with_chunked_prefill(
    arch_case: tuple[Path, dict[str, list[list[int]]]],
) -> None:
    model_dir, ref = arch_case
    got, llm = _generate(model_dir, _mixed_prompts(), max_num_batched_tokens=24)
    assert got == ref["mixed"]
    _assert_free(llm)


@pytest.mark.timeout(600)
def test_greedy_matches_with_preemption(
    arch_case: tuple[Path, dict[str, list[list[int]]]],
) -> None:
    model_dir, ref = arch_case
    # 16 blocks of 16 tokens hold one 232-token sequence, not all eight prompts at once.
    got, llm = _generate(model_dir, _mixed_prompts(), num_kv_blocks=16, max_num_batched_tokens=64)
    assert got == ref["mixed"]
    assert llm.statistics().num_preemptions > 0
    _assert_free(llm)
