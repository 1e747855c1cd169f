"""`AsyncLLM.embed` / `LLM.embed`: embeddings from the engine that also generates.

Each vector equals transformers' `AutoModel` `last_hidden_state` over the same prompt, pooled
the same way (fp32), through chunked prefill (16-token steps) and with the prefix cache on
(an embedding request computes its whole prompt), for the four architectures and both model
paths the CPU runs (the lean forward, and transformers with the torch attention); embedding
requests run in the same steps as generation requests in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncengine import LLM, AsyncLLM, SamplingParams
from asyncengine.testing.models import TINY_ARCHITECTURES

pytestmark = pytest.mark.timeout(180)

PROMPTS: list[list[int]] = [[5, 6, 7, 8], [5 + (7 * i) % 90 for i in range(37)], [100]]


def _reference(model_dir: Path, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    from transformers import AutoModel

    model: Any = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [P, hidden]
            out.append({"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling])
    return out


def _close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == w.numel()
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def _assert_free(llm: LLM) -> None:
    stats = llm.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_each_pooling_equals_transformers_hidden_states(
    tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    model = tiny_model_factory(arch)
    llm = LLM(model, device="cpu", dtype="float32", max_num_batched_tokens=16)
    # a generation with the same prompt first: its blocks are in the prefix cache
    llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
    for pooling in ("last", "mean", "cls"):
        got = llm.embed(PROMPTS, pooling=pooling, normalize=False)
        _close(got, _reference(model, PROMPTS, pooling))
    _assert_free(llm)


def test_the_transformers_path_pools_the_same(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("qwen2")
    llm = LLM(
        model, device="cpu", dtype="float32", attention_backend="torch", max_num_batched_tokens=16
    )
    _close(llm.embed(PROMPTS, pooling="mean", normalize=False), _reference(model, PROMPTS, "mean"))
    _assert_free(llm)


def test_normalize_and_dimensions(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, device="cpu", dtype="float32")
    raw = llm.embed("hello world", normalize=False)[0]
    unit = llm.embed("hello world")[0]
    assert math.isclose(math.fsum(v * v for v in unit), 1.0, rel_tol=1e-6)
    norm = math.sqrt(math.fsum(v * v for v in raw))
    assert unit == pytest.approx([v / norm for v in raw], rel=1e-6)
    cut = llm.embed(["hello world"], dimensions=16)[0]
    assert len(cut) == 16
    head_norm = math.sqrt(math.fsum(v * v for v in raw[:16]))
    assert cut == pytest.approx([v / head_norm for v in raw[:16]], rel=1e-6)  # cut, then norm
    assert llm.embed([[5, 6, 7]], dimensions=8, normalize=False)[0] == pytest.approx(
        llm.embed([5, 6, 7], normalize=False)[0][:8]
    )


@pytest.mark.parametrize(
    ("inputs", "options", "match"),
    [
        ([], {}, "inputs is empty"),
        ("hi", {"pooling": "max"}, r"pooling='max' is invalid: one of last, mean, cls"),
        ("hi", {"dimensions": 0}, r"dimensions=0 is invalid: an integer from 1 to .* 64"),
        ("hi", {"dimensions": 65}, "dimensions=65 is invalid"),
        ("hi", {"dimensions": True}, "dimensions=True is invalid"),
        ("hi", {"normalize": "yes"}, "normalize must be True or False"),
        (["hi", 3.5], {}, r"inputs\[1\] must be a string or a list of token ids, not float"),
        (b"hi", {}, "inputs must be a string, a list of token ids"),
        (["a"] * 2049, {}, "2049 inputs in one call: at most 2048"),
        ([[5, 6], [10**9]], {}, "prompt token ids must be in"),
        ([[]], {}, "empty"),
    ],
)
def test_bad_input_is_refused_and_the_engine_goes_on(
    tiny_llama: Path, inputs: Any, options: dict[str, Any], match: str
) -> None:
    llm = _shared_llm(tiny_llama)
    with pytest.raises(ValueError, match=match):
        llm.embed(inputs, **options)
    assert len(llm.embed(["still here"])[0]) == 64
    _assert_free(llm)


def test_a_prompt_longer_than_the_model_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    llm = LLM(tiny_model_factory("llama"), device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="32"):
        llm.embed([list(range(5, 45))])
    assert len(llm.embed([list(range(5, 30))])[0]) == 64


_LLMS: dict[Path, LLM] = {}


def _shared_llm(model: Path) -> LLM:
    if model not in _LLMS:
        _LLMS[model] = LLM(model, device="cpu", dtype="float32")
    return _LLMS[model]


@pytest.mark.anyio
async def test_async_embed_runs_beside_generation(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    want = _reference(model, PROMPTS, "last")
    engine = AsyncLLM.from_pretrained(
        model, device="cpu", dtype="float32", core="thread", max_num_batched_tokens=16
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with engine:
        tokens: list[int] = []
        embeddings: list[list[float]] = []

        async def generate() -> None:
            async for out in engine.generate(list(range(10, 50)), params):
                tokens[:] = out.outputs[0].token_ids

        async def embed() -> None:
            await anyio.sleep(0.01)  # while the generation is in its prefill or decodes
            embeddings.extend(await engine.embed(PROMPTS, normalize=False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            tg.start_soon(embed)
        assert len(tokens) == 24
        _close(embeddings, want)
        with pytest.raises(ValueError, match="pooling="):
            await engine.embed("x", pooling="first")
        stats = await engine.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.anyio
async def test_cancelling_embed_aborts_its_requests(tiny_llama: Path) -> None:
    engine = AsyncLLM.from_pretrained(tiny_llama, device="cpu", core="thread")
    async with engine:
        with anyio.move_on_after(0):
            await engine.embed([list(range(5, 60))] * 8)
        await anyio.sleep(0.2)
        stats = await engine.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert len((await engine.embed("after"))[0]) == 64
