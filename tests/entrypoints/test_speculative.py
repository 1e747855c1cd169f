"""n-gram speculative decoding end to end (offline LLM, tiny fp32 models): every request gives
the tokens it gives without speculation, greedy or seeded, with stop strings, max_tokens,
penalties, logprobs and n > 1; chunked prefill and preemption included; every KV block comes
back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.entrypoints import cli
from asyncengine.entrypoints.openai.metrics import ServerMetrics
from asyncengine.model import decode_layers

pytestmark = pytest.mark.timeout(300)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip


def _prompts() -> list[list[int]]:
    """Prompts that repeat (drafts are proposed from the first step) and ones that don't."""
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(4, 500, (12,), generator=g).tolist()
    return [
        motif * 4,
        motif[:5] * 6 + [7, 8],
        torch.randint(4, 500, (40,), generator=g).tolist() + motif * 2,
        torch.randint(4, 500, (30,), generator=g).tolist(),
        [9],
    ]


PROMPTS = _prompts()


def _engines(model: Path, **config: Any) -> Iterator[tuple[LLM, LLM]]:
    plain = LLM(model, device="cpu", dtype="float32", **config)
    spec = LLM(model, device="cpu", dtype="float32", speculative_config=SPEC, **config)
    yield plain, spec
    for llm in (plain, spec):
        stats = llm.statistics()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # rolled back, then freed
        llm.shutdown()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engines(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> Iterator[tuple[LLM, LLM]]:
    yield from _engines(tiny_model_factory(request.param))


def _compare(engines: tuple[LLM, LLM], params: SamplingParams) -> list[Any]:
    plain, spec = engines
    before = spec.statistics().num_accepted_tokens
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert len(g.outputs) == len(w.outputs)
        for wo, go in zip(w.outputs, g.outputs, strict=True):
            assert go.token_ids == wo.token_ids
            assert go.text == wo.text
            assert (go.finish_reason, go.stop_reason) == (wo.finish_reason, wo.stop_reason)
            _assert_same_logprobs(go.logprobs, wo.logprobs)
    return [spec.statistics().num_accepted_tokens - before, want]


def _assert_same_logprobs(got: Any, want: Any) -> None:
    """The same tokens, ranks and text; logprobs to float32 rounding (a position's logits
    come from a several-token chunk instead of a one-token step)."""
    if want is None:
        assert got is None
        return
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for token, entry in w.items():
            assert (g[token].rank, g[token].decoded_token) == (entry.rank, entry.decoded_token)
            assert g[token].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_greedy_tokens_equal_those_without_speculation(engines: tuple[LLM, LLM]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    accepted, _ = _compare(engines, params)
    assert accepted > 0  # drafts were proposed and accepted, not just rejected
    stats = engines[1].statistics()
    assert 0.0 < stats.spec_acceptance_rate <= 1.0
    assert engines[0].statistics().num_draft_tokens == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_greedy_tokens_are_exact_on_the_other_architectures(
    tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    for pair in _engines(tiny_model_factory(arch)):
        accepted, _ = _compare(pair, SamplingParams(temperature=0.0, max_tokens=40))
        assert accepted > 0


def test_seeded_sampling_gives_the_same_tokens(engines: tuple[LLM, LLM]) -> None:
    """A seeded request draws its noise per output position: the same tokens with or without
    speculation, and run to run."""
    params = SamplingParams(temperature=0.7, top_k=50, seed=5, max_tokens=30, ignore_eos=True)
    _compare(engines, params)
    again = engines[1].generate(PROMPTS, params, use_tqdm=False)
    first = engines[1].generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_max_tokens_is_reached_inside_a_draft(engines: tuple[LLM, LLM], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _compare(engines, params)


def test_stop_strings_and_stop_tokens_cut_where_they_did(engines: tuple[LLM, LLM]) -> None:
    plain = engines[0]
    free = plain.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    for i, out in enumerate(free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        # A stop string and a stop token taken from the middle of the output.
        stop = text[len(text) // 2 : len(text) // 2 + 3].strip() or text[:2]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        _compare_one(engines, PROMPTS[i], params)
        params = SamplingParams(
            temperature=0.0, max_tokens=40, stop_token_ids=[ids[len(ids) // 2]],
            include_stop_str_in_output=True,
        )  # fmt: skip
        _compare_one(engines, PROMPTS[i], params)


def _compare_one(engines: tuple[LLM, LLM], prompt: list[int], params: SamplingParams) -> None:
    want = engines[0].generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = engines[1].generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, want.finish_reason, want.stop_reason,
    )  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=0.4, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, stop_token_ids=[9, 40]),
        SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=20, ignore_eos=True),
    ],
    ids=["repetition", "presence-frequency", "min-tokens", "logprobs", "logprobs-stop", "n3"],
)
def test_sampling_options_behave_as_without_speculation(
    engines: tuple[LLM, LLM], params: SamplingParams
) -> None:
    accepted, _ = _compare(engines, params)
    if params.logprobs is not None:
        assert accepted > 0  # speculated, one logprobs entry per accepted token


@pytest.mark.parametrize(
    "config",
    [{"max_num_batched_tokens": 8}, {"num_kv_blocks": 40, "block_size": 4}],
    ids=["chunked-prefill", "preemption"],
)
def test_greedy_tokens_are_exact_under_a_small_budget_and_cache(
    tiny_model_factory: Callable[..., Path], config: dict[str, Any]
) -> None:
    for pair in _engines(tiny_model_factory("llama"), **config):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        accepted, _ = _compare(pair, params)
        assert accepted > 0
        if "num_kv_blocks" in config:
            assert pair[1].statistics().num_preemptions > 0


def test_the_cli_flag_passes_the_json_on() -> None:
    args = cli.build_parser().parse_args(
        ["generate", "some/model", "Hi", "--speculative-config", '{"num_speculative_tokens": 2}']
    )
    assert cli.engine_kwargs_from_args(args) == {
        "speculative_config": '{"num_speculative_tokens": 2}'
    }


def test_metrics_show_the_drafts(engines: tuple[LLM, LLM]) -> None:
    engines[1].generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    stats = engines[1].statistics()
    text = ServerMetrics("tiny").render(stats)
    labels = '{model_name="tiny",engine="0"}'
    assert (
        f"asyncengine_spec_decode_num_draft_tokens_total{labels} {stats.num_draft_tokens}" in text
    )
    accepted = stats.num_accepted_tokens
    assert f"asyncengine_spec_decode_num_accepted_tokens_total{labels} {accepted}" in text
    rate = stats.spec_acceptance_rate
    assert f"asyncengine_spec_decode_acceptance_rate{labels} {rate!r}" in text
    turn_downs = stats.num_spec_turn_downs
    assert f"asyncengine_spec_decode_num_turn_downs_total{labels} {turn_downs}" in text
    assert len(stats.spec_drafts_per_position) == SPEC["num_speculative_tokens"]
    assert stats.spec_accepted_per_position[0] > 0
    for name, counts in (
        ("num_drafts_per_pos_total", stats.spec_drafts_per_position),
        ("num_accepted_tokens_per_pos_total", stats.spec_accepted_per_position),
    ):
        for position, count in enumerate(counts):
            series = f'{labels[:-1]},position="{position}"}}'
            assert f"asyncengine_spec_decode_{name}{series} {count}" in text


def test_tensor_parallel_ranks_agree_on_the_accepted_tokens(tiny_llama: Path) -> None:
    """Every rank builds the same verify rows and the driver's tokens reach them all."""
    for pair in _engines(tiny_llama, tensor_parallel_size=2):
        accepted, _ = _compare(pair, SamplingParams(temperature=0.0, max_tokens=30))
        assert accepted > 0


def test_the_native_decode_call_verifies_drafts_in_bf16(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the lean CPU path a bf16 model's steps of a few tokens run in one native call
    (model/decode_layers.py), which takes several query tokens per sequence: a verify row
    (1 + k tokens after its cached context) runs there too. One request and k = 3, so a
    verify step fits the call's row limit on every CPU (4 where AMX is)."""
    native_steps = verify_steps = 0
    real = decode_layers.NativeDecodeLayers.__call__

    def spy(layers: Any, residual: torch.Tensor, cos: Any, sin: Any, attn: Any, *rest: Any) -> Any:
        nonlocal native_steps, verify_steps
        out = real(layers, residual, cos, sin, attn, *rest)
        if out is not None:
            plan = attn.plan
            lens = zip(plan.q_lens.tolist(), plan.seq_lens.tolist(), strict=True)
            native_steps += 1
            verify_steps += any(1 < q < s for q, s in lens)
        return out

    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "__call__", spy)
    config = {**SPEC, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = []
    for kw in ({}, {"speculative_config": config}):
        llm = LLM(tiny_llama, device="cpu", dtype="bfloat16", **kw)
        got.append(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids)
        stats = llm.statistics()
        llm.shutdown()
    if native_steps == 0:
        pytest.skip("the native decode call does not run here (no native bf16 kernels)")
    assert stats.num_accepted_tokens > 0 and verify_steps > 0
    # (The tokens also equal the unspeculated ones here, but bf16 exactness is not promised:
    # a k-row product may round differently from a one-row one on other kernels.)
    assert len(got[1]) == len(got[0])
