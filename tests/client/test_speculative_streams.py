"""AsyncLLM with n-gram speculation, over a real engine-core process: streams carry several
tokens per output and add up to the unspeculated tokens; leaving a stream aborts it and frees
its blocks, rolled-back drafts included; data-parallel ranks each speculate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import LLM, AsyncLLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(120)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Prompts that repeat, so drafts are proposed from the first step.
PROMPTS = [
    "hello world engine hello world engine hello world engine hello world",
    "the cache block of the cache block of the cache block of the",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[str, list[int]]:
    llm = LLM(tiny_llama, **ENGINE_KW)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_pretrained(
        tiny_llama, core="process", speculative_config=SPEC, **ENGINE_KW
    ) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def _idle_after(engine: AsyncLLM) -> AsyncIterator[None]:
    yield
    stats = await wait_until_idle(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_delta_stream_adds_up_to_the_unspeculated_tokens(
    engine: AsyncLLM, reference: dict[str, list[int]]
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for prompt in PROMPTS:
        deltas = [out.outputs[0].token_ids async for out in engine.generate(prompt, params)]
        assert [t for d in deltas for t in d] == reference[prompt]
    stats = await engine.statistics()
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens >= stats.num_accepted_tokens


async def test_leaving_a_stream_aborts_it_and_frees_its_blocks(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async for out in engine.generate(PROMPTS[0], params):
        if len(out.outputs[0].token_ids) >= 5:
            break  # the fixture checks every block is back


async def test_data_parallel_ranks_each_speculate(
    tiny_llama: Path, reference: dict[str, list[int]]
) -> None:
    """Each rank drafts and verifies its own requests; the totals add the ranks' counts."""
    async with AsyncLLM.from_pretrained(
        tiny_llama, speculative_config=SPEC, data_parallel_size=2, **ENGINE_KW
    ) as engine:
        for rank in (0, 1):
            for prompt in PROMPTS:
                final = None
                async for out in engine.generate(prompt, GREEDY, data_parallel_rank=rank):
                    final = out
                assert final is not None and final.outputs[0].token_ids == reference[prompt]
        stats = await wait_until_idle(engine)
        assert [r.data_parallel_rank for r in stats.ranks] == [0, 1]
        for rank in stats.ranks:
            assert rank.num_accepted_tokens > 0
            assert rank.num_free_kv_blocks == rank.num_kv_blocks
        assert stats.num_accepted_tokens == sum(r.num_accepted_tokens for r in stats.ranks)
        assert stats.num_draft_tokens == sum(r.num_draft_tokens for r in stats.ranks)
