"""The offline LLM API as a user sees it: ordering, seeds, stop conditions, n, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine import LLM, RequestOutputKind, SamplingParams
from asyncengine.client.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=256)


PROMPTS = ["hello world", "the engine is fast", "a", "async token cache block model of the world"]


def test_outputs_come_back_in_input_order_with_text(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.prompt for o in outs] == PROMPTS
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.finished and o.prompt_token_ids == tok.encode(o.prompt or "")
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert (
            c.text
            == tok.decode(o.prompt_token_ids + c.token_ids)[len(tok.decode(o.prompt_token_ids)) :]
        )


def test_one_params_per_prompt_and_token_id_prompts(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3)]
    outs = llm.generate([[5, 6, 7], [8], [9, 10]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert [o.prompt for o in outs] == [None, None, None]


def test_seed_gives_same_tokens_alone_or_batched(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["hello world"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        ["the engine", "hello world", "a b c"], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert (
        llm.generate(["hello world"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


def test_n_sequences_are_distinct_and_indexed(llm: LLM) -> None:
    out = llm.generate(
        "hello world",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[5]
    out = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    first = tokens.index(stop_at)
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_min_tokens_holds_off_eos(llm: LLM, tiny_llama: Path) -> None:
    # Bias nothing: with min_tokens the sequence cannot end before it has that many tokens.
    out = llm.generate(
        "hello",
        SamplingParams(temperature=1.0, seed=3, min_tokens=10, max_tokens=12),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 10


def test_stop_string_cuts_text_and_frees_the_request(llm: LLM) -> None:
    base = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    text = base[0].outputs[0].text
    assert len(text) > 12
    stop = text[6:10]
    cut = text[: text.index(stop)]
    out = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == cut and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        "hello world",
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == cut + stop
    stats = llm.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_logprobs_hold_the_sampled_token_and_top_n(llm: LLM) -> None:
    out = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, pos in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the most likely token
        assert 3 <= len(pos) <= 4
        assert all(lp.logprob <= 0.0 for lp in pos.values())


def test_delta_outputs_concatenate_to_the_full_text(tiny_llama: Path) -> None:
    engine = LLMEngine.from_kwargs(tiny_llama, device="cpu", dtype="float32")
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("d", "hello world", params)
    pieces: list[str] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            tokens.extend(out.outputs[0].token_ids)
    full = engine.tokenizer.decode(engine.tokenizer.encode("hello world") + tokens)
    assert "".join(pieces) == full[len("hello world") :]
    assert len(tokens) == 16


# ---- bad input: a clear ValueError, and the engine keeps serving ------------------------

BAD_PARAMS = [
    ("n", {"n": 0}),
    ("temperature", {"temperature": -1.0}),
    ("top_p", {"top_p": 0.0}),
    ("top_k", {"top_k": -5}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": -1}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [-3]}),
    ("presence_penalty", {"presence_penalty": 3.0}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("logprobs", {"logprobs": 50}),
    ("output_kind", {"output_kind": 7}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_PARAMS, ids=[f for f, _ in BAD_PARAMS])
def test_invalid_sampling_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*must"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([[5] * 300], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[5, 512, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # A bad prompt in a batch refuses the whole batch before anything is queued.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(
        "hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        LLM(tmp_path / "nope", device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["FrobnicatorForCausalLM"]
    for f in tiny_llama.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FrobnicatorForCausalLM"):
        LLM(tmp_path, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "dtype='int8'.*float32"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"max_model_len": 10**6}, "max_position_embeddings"),
        ({"scheduling_policy": "lifo"}, "fcfs, priority, sjf"),
    ],
)
def test_invalid_engine_config_names_the_keyword(
    tiny_llama: Path, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, **kwargs)


def test_unknown_engine_keyword(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="max_batch"):
        LLM(tiny_llama, device="cpu", max_batch=3)


def test_the_default_token_budget_depends_on_the_device_and_the_api(tiny_llama: Path) -> None:
    from asyncengine.config import EngineConfig

    def budget(**kwargs: object) -> int:
        config = EngineConfig.from_kwargs(tiny_llama, **kwargs)  # type: ignore[arg-type]
        return config.scheduler_config.max_num_batched_tokens

    assert budget(device="cpu") == 1024  # serving: shorter steps, earlier first tokens
    assert budget(device="cpu", max_num_batched_tokens=4096) == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        budget(device="cpu", max_num_batched_tokens=0)
    llm = LLM(tiny_llama, device="cpu", num_kv_blocks=8)  # offline: fewer, larger steps
    try:
        assert llm.config.scheduler_config.max_num_batched_tokens == 2048
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        # SmolLM2-135M: 106M weights in the layers
        ({"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
          "num_key_value_heads": 3, "intermediate_size": 1536}, 1024),
        # Qwen2.5-0.5B: 358M
        ({"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "intermediate_size": 4864}, 512),
        # Llama-3-8B: 7B, never below 256
        ({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 14336}, 256),
    ],
)  # fmt: skip
def test_the_cpu_serving_budget_shrinks_for_larger_models(
    tmp_path: Path, tiny_llama: Path, shape: dict[str, int], expected: int
) -> None:
    """A CPU step's time is its tokens times the layers' weights: larger models get fewer
    tokens a step by default (their steps are stalls for every running stream too), GPUs and
    explicit budgets are left alone."""
    import shutil

    from asyncengine.config import EngineConfig

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **shape}))
    cpu = EngineConfig.from_kwargs(folder, device="cpu")
    assert cpu.scheduler_config.max_num_batched_tokens == expected
    given = EngineConfig.from_kwargs(folder, device="cpu", max_num_batched_tokens=2048)
    assert given.scheduler_config.max_num_batched_tokens == 2048


def test_sjf_policy_serves_the_shortest_waiting_prompt_first(tiny_llama: Path) -> None:
    # One request at a time, all queued at once: first tokens come in prompt-length order,
    # and outputs still come back in input order.
    llm = LLM(
        tiny_llama, device="cpu", dtype="float32", scheduling_policy="sjf", max_num_seqs=1,
        max_num_batched_tokens=16,
    )  # fmt: skip
    try:
        prompts = [list(range(5, 45)), [5, 6, 7], list(range(5, 15))]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == prompts
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        firsts = [o.metrics.first_token_time for o in outs if o.metrics is not None]
        assert len(firsts) == 3 and firsts[1] < firsts[2] < firsts[0]  # type: ignore[operator]
    finally:
        llm.shutdown()
