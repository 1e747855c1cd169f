"""Mixed batches of LoRA adapters on the lean CPU forward (offline LLM): each request's greedy
tokens equal those of peft's merged model for its adapter, with three adapters and the base
model in one batch; the per-step bound (max_loras) and the loaded-set LRU (max_cpu_loras);
prefix-cache isolation between adapters; and a clear ValueError for every bad adapter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, LoRARequest, SamplingParams
from asyncengine.testing import TINY_ARCHITECTURES
from asyncengine.testing.lora import build_peft_adapter, peft_greedy
from asyncengine.worker.lora_manager import LoRAManager

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=256, enable_lora=True
)
# Three adapters on different projections, ranks and scalings; None is the base model.
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(target_modules=["q_proj", "v_proj"], rank=8, seed=1),
    "mlp": dict(target_modules=["gate_proj", "up_proj", "down_proj", "o_proj", "k_proj"],
                rank=4, use_rslora=True, seed=2),
    "all": dict(rank=16, seed=3),
}  # fmt: skip
NAMES: list[str | None] = ["attn", None, "mlp", "all"]


@dataclass
class Case:
    base: Path
    folders: dict[str, Path]
    prompts: list[list[int]]
    reference: dict[str | None, list[list[int]]]  # adapter -> each prompt's greedy tokens

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapter(name)

    def adapter(self, name: str) -> LoRARequest:
        return LoRARequest(name, self.folders[name])


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in (5, 19, 40, 1)]


def _case(base: Path, folder: Path) -> Case:
    folders = {n: build_peft_adapter(base, folder / n, **kw) for n, kw in ADAPTERS.items()}
    prompts = _prompts(0)
    reference = {
        name: peft_greedy(base, None if name is None else folders[name], prompts, NEW_TOKENS)
        for name in NAMES
    }
    return Case(base, folders, prompts, reference)


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def case(
    request: pytest.FixtureRequest,
    tiny_model_factory: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Case:
    base = tiny_model_factory(request.param)
    return _case(base, tmp_path_factory.mktemp(f"lora-{request.param}"))


@pytest.fixture(scope="module")
def llama_case(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return _case(tiny_llama, tmp_path_factory.mktemp("lora-llama"))


@pytest.fixture
def llm_factory() -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(base: Path, **config: Any) -> LLM:
        made.append(LLM(base, **{**ENGINE_KW, **config}))
        return made[-1]

    yield make
    for llm in made:
        stats = llm.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing left behind
        llm.shutdown()


def _mixed(case: Case) -> tuple[list[list[int]], list[LoRARequest | None], list[list[int]]]:
    """Every prompt under every adapter and the base, interleaved: one batch."""
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(case.prompts):
        for name in NAMES:
            prompts.append(prompt)
            loras.append(case.lora(name))
            expected.append(case.reference[name][i])
    return prompts, loras, expected


def _manager(llm: LLM) -> LoRAManager:
    manager = llm.engine.engine_core.executor.worker.model_runner.lora_manager  # type: ignore[attr-defined]
    assert isinstance(manager, LoRAManager)
    return manager


def _tokens(llm: LLM, prompts: list[list[int]], loras: Any) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_request_matches_peft_merged_model_in_one_mixed_batch(
    case: Case, llm_factory: Callable[..., LLM]
) -> None:
    # The adapters change the output (a LoRA that were not applied would pass for the base).
    for name in ADAPTERS:
        assert case.reference[name] != case.reference[None]
    llm = llm_factory(case.base)
    prompts, loras, expected = _mixed(case)
    assert _tokens(llm, prompts, loras) == expected


def test_max_loras_bounds_the_adapters_of_a_step_and_the_rest_wait(
    llama_case: Case, llm_factory: Callable[..., LLM]
) -> None:
    llm = llm_factory(llama_case.base, max_loras=1)
    manager = _manager(llm)
    per_step: list[set[str]] = []
    step_batch = manager.step_batch

    def recording(names: list[str | None], counts: list[int]) -> Any:
        per_step.append({n for n in names if n is not None})
        return step_batch(names, counts)

    manager.step_batch = recording  # type: ignore[method-assign]
    prompts, loras, expected = _mixed(llama_case)
    assert _tokens(llm, prompts, loras) == expected  # none refused: they waited their turn
    assert max(len(s) for s in per_step) == 1
    assert set().union(*per_step) == set(ADAPTERS)


def test_adapters_beyond_max_cpu_loras_are_unloaded_lru_and_reloaded(
    llama_case: Case, llm_factory: Callable[..., LLM]
) -> None:
    llm = llm_factory(llama_case.base, max_loras=1, max_cpu_loras=2)
    manager = _manager(llm)
    prompt = llama_case.prompts[1]
    for name in ("attn", "mlp", "all"):
        assert _tokens(llm, [prompt], llama_case.lora(name)) == [llama_case.reference[name][1]]
    assert list(manager.loaded) == ["mlp", "all"]  # "attn", least recently used, is out
    assert manager.num_loads == 3
    assert _tokens(llm, [prompt], llama_case.lora("attn")) == [llama_case.reference["attn"][1]]
    assert manager.num_loads == 4  # loaded again from its folder
    assert list(manager.loaded) == ["all", "attn"]
    assert sorted(r.name for r in llm.list_loras()) == ["all", "attn", "mlp"]


def test_a_prefix_cached_under_one_adapter_is_never_reused_by_another(
    llama_case: Case, llm_factory: Callable[..., LLM]
) -> None:
    llm = llm_factory(llama_case.base)
    prompt, i = llama_case.prompts[2], 2  # 40 tokens: two full blocks of 16

    def run(name: str | None) -> int:
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=llama_case.lora(name))
        assert list(out.outputs[0].token_ids) == llama_case.reference[name][i]
        assert out.metrics is not None
        return out.metrics.num_cached_tokens

    assert run(None) == 0
    assert run("attn") == 0  # not the base's blocks
    assert run("mlp") == 0  # nor another adapter's
    assert run("attn") == 32  # its own, yes
    assert run(None) == 32


def test_bad_adapters_and_names_are_clear_value_errors_and_the_engine_goes_on(
    llama_case: Case, llm_factory: Callable[..., LLM], tmp_path: Path
) -> None:
    llm = llm_factory(llama_case.base, max_lora_rank=8)
    prompt = llama_case.prompts[0]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope': the engine holds none"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("nope"))
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        llm.add_lora(llama_case.adapter("all"))
    with pytest.raises(ValueError, match="no such folder"):
        llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a PEFT folder"):
        llm.add_lora(LoRARequest("x", tmp_path))
    assert llm.add_lora(llama_case.adapter("attn"))
    assert not llm.add_lora(llama_case.adapter("attn"))
    with pytest.raises(ValueError, match=r"is loaded from .* already: remove_lora it first"):
        llm.add_lora(LoRARequest("attn", llama_case.folders["mlp"]))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([prompt], GREEDY, lora_request=[None, None])
    # Known by name alone once added; gone once removed.
    assert _tokens(llm, [prompt], LoRARequest("attn")) == [llama_case.reference["attn"][0]]
    llm.remove_lora("attn")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("attn"))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        llm.remove_lora("attn")
    assert llm.list_loras() == []
    assert _tokens(llm, [prompt], None) == [llama_case.reference[None][0]]


def test_lora_needs_enable_lora(llama_case: Case, llm_factory: Callable[..., LLM]) -> None:
    llm = llm_factory(llama_case.base, enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.add_lora(llama_case.adapter("attn"))


def test_the_transformers_path_refuses_enable_lora_at_start(llama_case: Case) -> None:
    with pytest.raises(ValueError, match="lean CPU forward only"):
        LLM(llama_case.base, **{**ENGINE_KW, "attention_backend": "torch"})


def test_an_adapter_removed_in_flight_stays_loaded_until_its_requests_finish(
    llama_case: Case, llm_factory: Callable[..., LLM]
) -> None:
    llm = llm_factory(llama_case.base)
    llm.add_lora(llama_case.adapter("attn"))
    manager, engine = _manager(llm), llm.engine
    request_id = engine.add_request("r", llama_case.prompts[1], GREEDY, lora_name="attn")
    outputs = engine.step()  # its prefill: it runs with the adapter now
    llm.remove_lora("attn")
    assert "attn" in manager.adapters  # still in use
    with pytest.raises(ValueError, match="is being removed and requests still use it"):
        llm.add_lora(llama_case.adapter("attn"))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        llm.generate([llama_case.prompts[0]], GREEDY, lora_request=LoRARequest("attn"))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    (final,) = [o for o in outputs if o.request_id == request_id]
    assert list(final.outputs[0].token_ids) == llama_case.reference["attn"][1]
    assert "attn" not in manager.adapters and "attn" not in manager.loaded


def test_llm_chat_with_an_adapter_is_generate_on_the_rendered_prompt(
    llama_case: Case, chat_model: Path, llm_factory: Callable[..., LLM]
) -> None:
    # chat_model is tiny_llama with a chat template: the same weights, so the same adapters.
    llm = llm_factory(chat_model)
    hello = [{"role": "user", "content": "hello"}]
    (chat,) = llm.chat(hello, GREEDY, use_tqdm=False, lora_request=llama_case.adapter("mlp"))
    assert chat.prompt is not None
    ids = llm.get_tokenizer().encode(chat.prompt, add_special_tokens=False)
    assert list(chat.outputs[0].token_ids) == _tokens(llm, [ids], LoRARequest("mlp"))[0]
    (base,) = llm.chat(hello, GREEDY, use_tqdm=False)
    assert list(base.outputs[0].token_ids) != list(chat.outputs[0].token_ids)


def test_adapters_with_speculative_decoding_keep_greedy_exactness(
    llama_case: Case, llm_factory: Callable[..., LLM]
) -> None:
    # Repetitive prompts, so the n-gram proposer drafts; the verify rows run with the adapter.
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 9]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = llm_factory(llama_case.base, speculative_config=spec)
    names: list[str | None] = ["attn", None, "all"]
    expected = {
        n: peft_greedy(llama_case.base, n and llama_case.folders[n], prompts, NEW_TOKENS)
        for n in names
    }
    loras = [llama_case.lora(n) for n in names for _ in prompts]
    got = _tokens(llm, prompts * len(names), loras)
    assert got == [expected[n][i] for n in names for i in range(len(prompts))]
    stats = llm.statistics()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # it did speculate
