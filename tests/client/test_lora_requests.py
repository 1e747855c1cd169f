"""LoRA adapters through AsyncLLM (a real core process, on asyncio and trio): generate() and
chat() with `lora_request`, the adapter added on first use; add_lora / list_loras /
remove_lora; a removed adapter's requests in flight finish first; every bad name or folder is
a ValueError for its caller only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import AsyncLLM, LoRARequest, SamplingParams
from asyncengine.testing.lora import build_peft_adapter, peft_greedy

pytestmark = pytest.mark.timeout(180)

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, seed=1),
    "mlp": dict(target_modules=["gate_proj", "up_proj", "down_proj"], rank=4, seed=2),
    "all": dict(rank=16, use_rslora=True, seed=3),
}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def adapters(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("lora-client")
    return {n: build_peft_adapter(chat_model, folder / n, **kw) for n, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in (3, 21, 40)]


@pytest.fixture(scope="module")
def reference(
    chat_model: Path, adapters: dict[str, Path], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    names: list[str | None] = [None, *adapters]
    return {
        n: peft_greedy(chat_model, None if n is None else adapters[n], prompts, NEW_TOKENS)
        for n in names
    }


@pytest.fixture(scope="module")
async def engine(chat_model: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_pretrained(
        chat_model, enable_lora=True, max_lora_rank=16, **ENGINE_KW
    ) as engine:
        yield engine


async def _tokens(engine: AsyncLLM, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    final = None
    async for out in engine.generate(prompt, GREEDY, lora_request=lora):
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def _assert_kv_free(engine: AsyncLLM) -> None:
    stats = await wait_until_idle(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_concurrent_requests_for_three_adapters_and_the_base_match_peft(
    engine: AsyncLLM,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:
    got: dict[tuple[str | None, int], list[int]] = {}

    async def run(name: str | None, i: int) -> None:
        lora = None if name is None else LoRARequest(name, adapters[name])
        got[(name, i)] = await _tokens(engine, prompts[i], lora)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            for name in [None, *adapters]:
                tg.start_soon(run, name, i)
    assert got == {(n, i): reference[n][i] for n, i in got}
    assert sorted(r.name for r in await engine.list_loras()) == sorted(adapters)
    await _assert_kv_free(engine)


async def test_chat_with_an_adapter_is_generate_on_the_rendered_prompt(
    engine: AsyncLLM, adapters: dict[str, Path]
) -> None:
    lora = LoRARequest("mlp", adapters["mlp"])
    chats: dict[str | None, tuple[str, list[int]]] = {}
    for name, request in (("mlp", lora), (None, None)):
        async for out in engine.chat(HELLO, GREEDY, lora_request=request):
            chats[name] = (out.prompt or "", list(out.outputs[0].token_ids))
    prompt, tokens = chats["mlp"]
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert await _tokens(engine, ids, LoRARequest("mlp")) == tokens
    assert chats[None][1] != tokens  # the adapter changed the answer
    await _assert_kv_free(engine)


async def test_add_list_and_remove_adapters_at_run_time(
    engine: AsyncLLM, adapters: dict[str, Path], prompts: list[list[int]], reference: Any
) -> None:
    assert await engine.add_lora(LoRARequest("runtime", adapters["attn"]))
    assert not await engine.add_lora(LoRARequest("runtime", adapters["attn"]))  # held already
    assert "runtime" in {r.name for r in await engine.list_loras()}
    assert await _tokens(engine, prompts[1], LoRARequest("runtime")) == reference["attn"][1]
    await engine.remove_lora("runtime")
    assert "runtime" not in {r.name for r in await engine.list_loras()}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'runtime'"):
        await _tokens(engine, prompts[1], LoRARequest("runtime"))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'runtime'"):
        await engine.remove_lora("runtime")
    # Added again, from its folder, it serves as before.
    assert (
        await _tokens(engine, prompts[1], LoRARequest("runtime", adapters["attn"]))
        == (reference["attn"][1])
    )
    await engine.remove_lora("runtime")
    await _assert_kv_free(engine)


async def test_removing_an_adapter_lets_its_requests_in_flight_finish(
    engine: AsyncLLM, adapters: dict[str, Path], prompts: list[list[int]], reference: Any
) -> None:
    lora = LoRARequest("leaving", adapters["all"])
    final = None
    async for out in engine.generate(prompts[2], GREEDY, lora_request=lora):
        if final is None:  # after its first token: unload it under the running request
            await engine.remove_lora("leaving")
            with pytest.raises(ValueError, match="unknown LoRA adapter 'leaving'"):
                await _tokens(engine, prompts[0], LoRARequest("leaving"))
        final = out
    assert final is not None and list(final.outputs[0].token_ids) == reference["all"][2]
    await _assert_kv_free(engine)


async def test_bad_folders_and_names_are_value_errors_and_others_go_on(
    engine: AsyncLLM,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    reference: Any,
    tmp_path: Path,
    tiny_model_factory: Any,
) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        await engine.add_lora(LoRARequest("x", tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a PEFT folder"):
        await _tokens(engine, prompts[0], LoRARequest("x", tmp_path))
    big = build_peft_adapter(engine.config.model_config.model, tmp_path / "big", rank=32)
    with pytest.raises(ValueError, match="rank 32, above max_lora_rank=16"):
        await engine.add_lora(LoRARequest("big", big))
    other = tiny_model_factory("qwen2", hidden_size=32)
    with pytest.raises(ValueError, match="an adapter for another model"):
        await engine.add_lora(LoRARequest("other", build_peft_adapter(other, tmp_path / "o")))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nobody'"):
        await _tokens(engine, prompts[0], LoRARequest("nobody"))
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        await _tokens(engine, prompts[0], "attn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"add_lora.*needs a path"):
        await engine.add_lora(LoRARequest("nopath"))
    assert await _tokens(engine, prompts[0], None) == reference[None][0]
    await _assert_kv_free(engine)


async def test_a_name_the_core_does_not_hold_fails_only_its_request(
    engine: AsyncLLM, prompts: list[list[int]], reference: Any
) -> None:
    # As when another API server removed the adapter a moment ago: this client still lists
    # it, the core refuses the request, and its stream raises.
    engine._loras["ghost"] = "/nowhere"
    try:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'ghost'"):
            await _tokens(engine, prompts[0], LoRARequest("ghost"))
    finally:
        del engine._loras["ghost"]
    assert await _tokens(engine, prompts[0], None) == reference[None][0]
    await _assert_kv_free(engine)


async def test_every_data_parallel_rank_serves_the_adapters(
    chat_model: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:
    # add_lora reaches every rank (a utility call goes to each), so a request for an adapter
    # may be routed to either.
    kw = dict(ENGINE_KW, data_parallel_size=2, data_parallel_routing="round_robin")
    async with AsyncLLM.from_pretrained(chat_model, enable_lora=True, max_lora_rank=16, **kw) as dp:
        assert await dp.add_lora(LoRARequest("attn", adapters["attn"]))
        got: dict[tuple[str | None, int], list[int]] = {}

        async def run(name: str | None, i: int) -> None:
            lora = None if name is None else LoRARequest(name, adapters[name])
            got[(name, i)] = await _tokens(dp, prompts[i], lora)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for name in (None, "attn", "mlp"):
                    tg.start_soon(run, name, i)
        assert got == {(n, i): reference[n][i] for n, i in got}
        stats = await wait_until_idle(dp)
        assert {s.data_parallel_rank for s in stats.ranks} == {0, 1}
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
