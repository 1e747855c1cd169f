"""Speculative decoding's scheduler side (sched/spec_decode.py) and its config.

A deterministic fake model (the next token is a function of the last two) stands in for the
runner: it verifies drafts as the real runner does, so outputs with and without speculation
must be equal token for token, and every KV block must come back.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from asyncengine.ipc.messages import EngineCoreRequest, EngineStats, FinishReason
from asyncengine.ipc.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.ipc.serial import decode_config, encode_config
from asyncengine.sampling_params import SamplingParams
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.scheduler import Scheduler
from asyncengine.sched.spec_decode import (
    MAX_PAUSE_STEPS,
    MAX_STEP_TOKENS,
    PAUSE_STEPS,
    WINDOW_TOKENS,
)

pytestmark = pytest.mark.timeout(120)

EOS = 0
BLOCK = 4
MAX_MODEL_LEN = 96


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"method='eagle' is invalid.*ngram"),
        ({"method": "ngram"}, r"needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens=0 is invalid.*\[1, 16\]"),
        ({"num_speculative_tokens": 17}, r"num_speculative_tokens=17 is invalid.*\[1, 16\]"),
        ({"num_speculative_tokens": True}, r"num_speculative_tokens=True is invalid"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 0},
            r"prompt_lookup_min=0 is invalid: must be an integer >= 1",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_max=2 is invalid.*\[prompt_lookup_min \(3\), 64\]",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 1}, r"unknown field\(s\) 'lookahead'"),
        ("{not json", r"speculative_config is not valid JSON"),
        (4, r"speculative_config=4 is invalid: must be a dict"),
    ],
)
def test_a_bad_speculative_config_names_its_field(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_value(value)


def test_the_keyword_takes_a_dict_or_json_and_crosses_to_the_core(tiny_llama: Path) -> None:
    fields = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    for value in (fields, json.dumps(fields)):
        config = EngineConfig.from_kwargs(tiny_llama, device="cpu", speculative_config=value)
        spec = config.scheduler_config.speculative
        assert spec == SpeculativeConfig(3, "ngram", 1, 5)
        assert decode_config(encode_config(config)) == config
    off = EngineConfig.from_kwargs(tiny_llama, device="cpu")
    assert off.scheduler_config.speculative is None


# ---- a fake model whose outputs repeat ------------------------------------------------------


def _next_token(tokens: list[int], vocab: int) -> int:
    """The fake model's greedy token after `tokens`: it falls into loops, as small models do,
    so n-gram drafts are often right; EOS (0) now and then."""
    return (tokens[-1] * 7 + (tokens[-2] if len(tokens) > 1 else 1) * 3 + 1) % vocab


class VerifyingRunner:
    """What the worker does with a SchedulerOutput: it tracks each request's tokens, and
    verifies drafts against `_next_token` at each drafted position (greedy acceptance)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_drafted = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            self.computed[cached.request_id] = cached.num_computed_tokens
        sampled = []
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            done = self.computed[rid] + n
            assert done <= len(tokens) + len(drafts) <= MAX_MODEL_LEN
            if drafts:
                assert self.computed[rid] == len(tokens) - 1, "drafts only on a decode"
            if done < len(tokens) + len(drafts):
                sampled.append([])  # a prefill chunk short of the end
                continue
            self.num_drafted += len(drafts)
            emitted = [_next_token(tokens, self.vocab)]
            for draft in drafts:
                if draft != emitted[-1]:
                    break
                emitted.append(_next_token(tokens + emitted, self.vocab))
            tokens.extend(emitted)
            sampled.append(emitted)
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def _scheduler(
    num_blocks: int,
    budget: int,
    max_seqs: int,
    spec: SpeculativeConfig | None,
    prefix: bool,
    max_model_len: int = MAX_MODEL_LEN,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        policy="fcfs",
        speculative=spec,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, prefix), eos_token_ids=(EOS,))


def _run(
    requests: list[EngineCoreRequest],
    spec: SpeculativeConfig | None,
    *,
    num_blocks: int = 200,
    budget: int = 64,
    max_seqs: int = 8,
    prefix: bool = True,
    vocab: int = 23,
) -> tuple[dict[str, list[int]], dict[str, FinishReason], Scheduler, VerifyingRunner]:
    sched = _scheduler(num_blocks, budget, max_seqs, spec, prefix)
    runner = VerifyingRunner(vocab)
    for request in requests:
        sched.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: dict[str, FinishReason] = {}
    kv = sched.kv_cache_manager
    for _step in range(3000):
        if not sched.has_requests():
            break
        out = sched.schedule()
        assert 0 < out.total_num_scheduled_tokens <= budget
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            assert out.num_scheduled_tokens[rid] == 1 + len(drafts)
        result = sched.update_from_output(out, runner.execute(out))
        for o in result.outputs:
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
        for request in sched.running:
            # Rolled back: the request holds the blocks of its computed tokens and no more,
            # and only blocks full of its own (accepted) tokens are hashed.
            assert len(kv.get_block_ids(request.request_id)) == -(
                -request.num_computed_tokens // BLOCK
            )
            assert kv.num_cached_blocks.get(request.request_id, 0) <= request.num_tokens // BLOCK
            assert request.num_computed_tokens < request.num_tokens  # no draft is left in
    assert not sched.has_requests()
    assert kv.num_free_blocks == num_blocks
    return outputs, finished, sched, runner


def _requests(rng: random.Random, count: int, vocab: int = 23) -> list[EngineCoreRequest]:
    requests = []
    for i in range(count):
        motif = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 6))]
        prompt = (motif * 8)[: rng.randint(2, 40)]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 40),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(1, vocab)] if rng.random() < 0.3 else None,
        )
        requests.append(EngineCoreRequest(f"r{i}", prompt, params, arrival_time=float(i)))
    return requests


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(30, 120),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    k=st.integers(1, 6),
)
def test_outputs_equal_those_without_speculation(
    seed: int, num_blocks: int, budget: int, max_seqs: int, prefix: bool, k: int
) -> None:
    """Whatever the budget, the KV cache (preemptions), EOS, stop tokens or max_tokens inside
    a draft: the same tokens and finish reasons, and every block back in the pool."""
    requests = _requests(random.Random(seed), 6)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3)
    plain, plain_reasons, _, _ = _run(
        requests, None, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, prefix=prefix
    )
    fast, fast_reasons, sched, runner = _run(
        requests, spec, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, prefix=prefix
    )
    assert fast == plain
    assert fast_reasons == plain_reasons
    stats = sched.statistics()
    assert stats.num_draft_tokens == runner.num_drafted
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_drafts_are_accepted_and_counted() -> None:
    prompt = [1, 2, 3, 4] * 6
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    requests = [EngineCoreRequest("a", prompt, params, 0.0)]
    plain, _, plain_sched, _ = _run(requests, None, vocab=5)  # it loops within 25 tokens
    fast, _, sched, _ = _run(requests, SPEC, vocab=5)
    assert fast == plain and len(fast["a"]) == 60
    stats = sched.statistics()
    assert stats.num_accepted_tokens > 0
    assert 0.0 < stats.spec_acceptance_rate <= 1.0
    assert plain_sched.statistics().num_draft_tokens == 0
    assert sum(stats.spec_accepted_per_position) == stats.num_accepted_tokens
    assert sum(stats.spec_drafts_per_position) == stats.num_draft_tokens
    assert len(stats.spec_drafts_per_position) == SPEC.num_speculative_tokens
    # A later position is drafted, and accepted, no more often than an earlier one.
    for earlier, later in itertools.pairwise(stats.spec_accepted_per_position):
        assert earlier >= later
    total = EngineStats.total([stats, plain_sched.statistics()])
    assert total.spec_accepted_per_position == stats.spec_accepted_per_position


def _decoding(
    spec: SpeculativeConfig,
    params: SamplingParams,
    budget: int = 64,
    prompt: tuple[int, ...] = (1, 2, 3, 1, 2, 3, 1, 2),
    max_model_len: int = MAX_MODEL_LEN,
) -> Scheduler:
    """A scheduler whose one request ("a") has its `prompt` computed and one output token,
    3; its next steps have `budget` tokens."""
    sched = _scheduler(max(50, max_model_len // BLOCK + 2), 64, 4, spec, True, max_model_len)
    sched.add_request(EngineCoreRequest("a", list(prompt), params, 0.0))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[3]]))
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=budget)
    return sched


def test_drafts_fit_max_tokens_and_the_budget() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sched = _decoding(SPEC, params)
    # One output so far: at most 3 more, so 2 drafts and the model's own token.
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [1, 2]}
    sched = _decoding(SPEC, SamplingParams(temperature=0.0, max_tokens=50), budget=3)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert out.num_scheduled_tokens == {"a": 3}


@pytest.mark.parametrize(
    ("params", "budget"),
    [
        (SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), 64),  # one to go
        (SamplingParams(temperature=0.0, max_tokens=20), 1),  # no budget for a draft
    ],
)
def test_some_steps_decode_unspeculated(params: SamplingParams, budget: int) -> None:
    out = _decoding(SPEC, params, budget).schedule()
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1}


def test_rejected_drafts_give_their_blocks_back() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_max=3)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    sched = _decoding(spec, params, prompt=(*range(1, 13), 1, 2))
    kv = sched.kv_cache_manager
    out = sched.schedule()
    # Tokens 1..12 1 2 3: "1 2 3" occurred at the start, and 4..9 followed it. 14 tokens
    # computed, and 1 + 6 positions more, in 6 blocks of 4.
    assert out.scheduled_spec_decode_tokens == {"a": list(range(4, 10))}
    assert len(kv.get_block_ids("a")) == 6
    free = kv.num_free_blocks
    # The model takes two of them, then its own token: 17 computed, 18 tokens, 5 blocks.
    emitted = [[4, 5, 99]]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=emitted))
    request = sched.requests["a"]
    assert request.num_computed_tokens == 17 and request.output_token_ids == [3, 4, 5, 99]
    assert len(kv.get_block_ids("a")) == 5
    assert kv.num_free_blocks == free + 1
    assert sched.statistics().num_accepted_tokens == 2


def _fail_until_turn_down(sched: Scheduler, accept: bool = False) -> list[int]:
    """Steps of request "a" whose drafts the model never takes (or, with `accept`, always
    takes), until a window's worth of them were verified; each step's number of drafts."""
    speculator = sched.speculator
    assert speculator is not None
    drafted: list[int] = []
    for _step in range(WINDOW_TOKENS + 1):
        out = sched.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        drafted.append(len(drafts))
        # The model takes every draft, or none, but its tokens keep matching earlier ones.
        tokens = [*drafts, 3] if accept else [2 if drafts and drafts[0] == 1 else 1]
        sched.update_from_output(out, ModelRunnerOutput(["a"], [tokens]))
        if drafts and speculator._windows["a"].drafted == 0:  # the window ended
            break
    return drafted


def _paused_steps(sched: Scheduler, limit: int) -> int:
    """Steps of request "a" without drafts until it drafts again (at most `limit` + 1)."""
    for step in range(limit + 1):
        out = sched.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        if drafts:  # its first draft again: leave this step unfinished for the caller
            sched.update_from_output(out, ModelRunnerOutput(["a"], [[2 if drafts[0] == 1 else 1]]))
            return step
        sched.update_from_output(out, ModelRunnerOutput(["a"], [[1]]))
    return limit + 1


def test_a_request_whose_drafts_fail_stops_drafting_for_a_while() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    sched = _decoding(SPEC, params, prompt=(1, 2, 3) * 4, max_model_len=2048)
    speculator = sched.speculator
    assert speculator is not None
    drafted = _fail_until_turn_down(sched)
    # Every step drafted until a window's worth of drafts failed...
    assert all(drafted) and sum(drafted) >= WINDOW_TOKENS > sum(drafted[:-1])
    assert speculator.num_turn_downs == 1
    # ...then it decodes plainly for PAUSE_STEPS steps, and drafts again; each window in a
    # row that fails doubles the pause, up to MAX_PAUSE_STEPS.
    assert _paused_steps(sched, PAUSE_STEPS) == PAUSE_STEPS
    pauses = []
    while len(pauses) < 4:
        _fail_until_turn_down(sched)
        pauses.append(_paused_steps(sched, MAX_PAUSE_STEPS))
    expected = [min(PAUSE_STEPS << i, MAX_PAUSE_STEPS) for i in range(1, 5)]
    assert pauses == expected and expected[-1] == MAX_PAUSE_STEPS
    # A window whose drafts were taken ends the run: the next failing one pauses briefly.
    _fail_until_turn_down(sched, accept=True)
    _fail_until_turn_down(sched)
    assert _paused_steps(sched, MAX_PAUSE_STEPS) == PAUSE_STEPS
    assert sched.statistics().num_spec_turn_downs == 6
    sched.abort_requests(["a"])
    assert not speculator._windows  # forgotten with its request


def test_a_structured_output_request_decodes_unspeculated() -> None:
    """Its drafts would not be checked against its grammar (docs/speculative.md)."""
    sched = _decoding(SPEC, SamplingParams(temperature=0.0, max_tokens=20))
    sched.requests["a"].grammar = object()  # type: ignore[assignment]  # any grammar at all
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize("num_requests", [1, 2, 3, MAX_STEP_TOKENS, MAX_STEP_TOKENS + 2])
def test_a_large_batch_drafts_less_then_not_at_all(num_requests: int) -> None:
    """A step's decode rows and drafts stay within MAX_STEP_TOKENS (extra rows cost time),
    shared out evenly between its requests."""
    spec = SpeculativeConfig(num_speculative_tokens=16, prompt_lookup_max=3)
    sched = _scheduler(200, 512, 16, spec, True)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(EngineCoreRequest(f"r{i}", list(range(1, 30)) * 2, params, float(i)))
    out = sched.schedule()  # the prompts
    emitted = [[1] for _ in out.num_scheduled_tokens]
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), emitted))
    out = sched.schedule()
    counts = [len(out.scheduled_spec_decode_tokens.get(f"r{i}", [])) for i in range(num_requests)]
    assert sum(counts) == max(0, MAX_STEP_TOKENS - num_requests)
    assert max(counts) - min(counts) <= 1  # shared out evenly
    assert out.total_num_scheduled_tokens == max(MAX_STEP_TOKENS, num_requests)
