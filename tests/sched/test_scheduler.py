"""Scheduler invariants under random workloads, with a fake model that samples at random."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.config import SchedulerConfig
from asyncengine.ipc.messages import EngineCoreRequest, EngineStats, FinishReason
from asyncengine.ipc.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.scheduler import Scheduler

EOS = 0


class FakeRunner:
    """Tracks what a worker would: each request's tokens; samples random tokens."""

    def __init__(self, rng: random.Random, vocab: int = 50) -> None:
        self.rng = rng
        self.vocab = vocab
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

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
            assert n >= 1
            done = self.computed[rid] + n
            assert done <= len(self.tokens[rid]), "scheduled tokens the worker does not know"
            if done == len(self.tokens[rid]):
                tok = self.rng.randrange(self.vocab)
                self.tokens[rid].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def _make(num_blocks: int, budget: int, max_seqs: int, policy: str, prefix: bool) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=128, policy=policy
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, prefix), eos_token_ids=(EOS,))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(34, 80),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority", "sjf"]),
    prefix=st.booleans(),
    num_requests=st.integers(1, 12),
)
def test_random_workload_keeps_invariants(
    seed: int,
    num_blocks: int,
    budget: int,
    max_seqs: int,
    policy: str,
    prefix: bool,
    num_requests: int,
) -> None:
    rng = random.Random(seed)
    sched = _make(num_blocks, budget, max_seqs, policy, prefix)
    runner = FakeRunner(rng)
    shared = [rng.randrange(1, 50) for _ in range(24)]
    pending = []
    for i in range(num_requests):
        plen = rng.randint(1, 60)
        prompt = (shared[: rng.randint(0, 24)] + [rng.randrange(1, 50) for _ in range(plen)])[:100]
        params = SamplingParams(max_tokens=rng.randint(1, 28), ignore_eos=rng.random() < 0.5)
        pending.append(
            EngineCoreRequest(
                f"r{i}", prompt, params, arrival_time=float(i), priority=rng.randint(0, 3)
            )
        )
    finished: dict[str, FinishReason] = {}
    for _step in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running).request_id
            sched.abort_requests([victim])
            finished[victim] = FinishReason.ABORT
        if not sched.has_requests() and not pending:
            break
        out = sched.schedule()
        # The token budget is never exceeded, nor max_num_seqs, nor max_model_len.
        assert out.total_num_scheduled_tokens <= budget
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(sched.running) <= max_seqs
        for rid in out.num_scheduled_tokens:
            assert sched.requests[rid].num_computed_tokens <= 128
        if sched.has_requests():
            assert out.total_num_scheduled_tokens > 0, "a step with work scheduled nothing"
        result = sched.update_from_output(out, runner.execute(out))
        for o in result.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
        kv = sched.kv_cache_manager
        held = sum(len(kv.get_block_ids(r.request_id)) for r in sched.running)
        assert kv.num_free_blocks + held >= kv.num_blocks - held  # sanity: no negative counts
    assert not sched.has_requests() and not pending
    assert len(finished) == num_requests
    # Every block is back in the pool once all requests are finished or aborted.
    assert sched.kv_cache_manager.num_free_blocks == num_blocks


def test_request_that_cannot_fit_is_refused_with_its_sizes() -> None:
    sched = _make(num_blocks=4, budget=16, max_seqs=4, policy="fcfs", prefix=True)
    req = EngineCoreRequest("big", list(range(1, 15)), SamplingParams(max_tokens=8), 0.0)
    try:
        sched.add_request(req)
    except ValueError as e:
        assert "KV blocks" in str(e) and "big" in str(e)
    else:
        raise AssertionError("expected ValueError")
    assert not sched.has_requests()


def test_duplicate_request_id_is_refused() -> None:
    sched = _make(num_blocks=40, budget=16, max_seqs=4, policy="fcfs", prefix=True)
    sched.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(), 0.0))
    try:
        sched.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(), 0.0))
    except ValueError as e:
        assert "already in use" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_priority_policy_admits_lower_priority_value_first() -> None:
    sched = _make(num_blocks=40, budget=4, max_seqs=1, policy="priority", prefix=False)
    sched.add_request(EngineCoreRequest("late-low", [1, 2, 3], SamplingParams(), 0.0, priority=5))
    sched.add_request(EngineCoreRequest("urgent", [4, 5, 6], SamplingParams(), 1.0, priority=0))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["urgent"]


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    sched = _make(num_blocks=60, budget=8, max_seqs=4, policy="fcfs", prefix=False)
    runner = FakeRunner(random.Random(0))
    sched.add_request(
        EngineCoreRequest("short", [1, 2], SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    )
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    sched.add_request(EngineCoreRequest("long", list(range(1, 30)), SamplingParams(), 1.0))
    out = sched.schedule()
    # One decode token for "short", the rest of the budget goes to a chunk of "long".
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}


def _sjf(budget: int = 64, max_seqs: int = 1) -> Scheduler:
    return _make(num_blocks=200, budget=budget, max_seqs=max_seqs, policy="sjf", prefix=False)


def _request(rid: str, num_tokens: int, arrival: float) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(range(1, num_tokens + 1)), SamplingParams(), arrival)


def test_sjf_admits_the_shortest_of_simultaneous_prompts_first() -> None:
    sched = _sjf()
    for rid, n in (("long", 40), ("short", 5), ("mid", 20)):
        sched.add_request(_request(rid, n, arrival=1.0))
    assert [r.request_id for r in sched.waiting] == ["short", "mid", "long"]
    assert list(sched.schedule().num_scheduled_tokens) == ["short"]


def test_sjf_ages_a_long_prompt_by_its_arrival() -> None:
    # At 1 ms a token, 35 tokens fewer buy 35 ms: a short prompt arriving 50 ms after a long
    # one waits behind it, one arriving 20 ms after it goes first.
    sched = _sjf()
    queue = sched.waiting
    queue.seconds_per_token = 1e-3  # type: ignore[attr-defined]
    sched.add_request(_request("long", 40, arrival=1.0))
    sched.add_request(_request("short-late", 5, arrival=1.05))
    sched.add_request(_request("short-soon", 5, arrival=1.02))
    assert [r.request_id for r in queue] == ["short-soon", "long", "short-late"]


def test_sjf_learns_seconds_per_token_from_prefill_steps_only() -> None:
    sched = _sjf(budget=64)
    queue = sched.waiting
    before = queue.seconds_per_token  # type: ignore[attr-defined]
    sched.add_request(_request("a", 8, arrival=0.0))
    out = sched.schedule()  # 8 tokens: under a quarter of the budget, says nothing
    sched.record_step_time(out, 1.0)
    assert queue.seconds_per_token == before  # type: ignore[attr-defined]
    sched.add_request(_request("b", 60, arrival=0.0))
    sched.abort_requests(["a"])
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 60
    for _ in range(40):
        sched.record_step_time(out, 0.6)  # 10 ms a token
    assert abs(queue.seconds_per_token - 0.01) < 1e-4  # type: ignore[attr-defined]


def test_sjf_preempts_the_latest_ranked_and_requeues_it() -> None:
    # Two running requests outgrow a small cache: the one ranked last (the longer prompt) is
    # preempted, goes back to the waiting queue, and still finishes.
    sched = _make(num_blocks=7, budget=64, max_seqs=2, policy="sjf", prefix=False)
    runner = FakeRunner(random.Random(0))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    sched.add_request(EngineCoreRequest("long", list(range(1, 13)), params, 0.0))
    sched.add_request(EngineCoreRequest("short", list(range(1, 9)), params, 0.0))
    finished, preempted = set(), set()
    for _ in range(100):
        if not sched.has_requests():
            break
        out = sched.schedule()
        preempted |= {r.request_id for r in sched.waiting if r.num_preemptions}
        for o in sched.update_from_output(out, runner.execute(out)).outputs:
            if o.finish_reason is not None:
                finished.add(o.request_id)
    assert preempted == {"long"}
    assert finished == {"long", "short"}
    assert sched.kv_cache_manager.num_free_blocks == 7


def test_statistics_is_a_frozen_snapshot_with_the_hit_rate() -> None:
    sched = _make(num_blocks=10, budget=64, max_seqs=8, policy="fcfs", prefix=True)
    assert sched.statistics() == EngineStats(
        num_running_reqs=0,
        num_waiting_reqs=0,
        num_preemptions=0,
        num_kv_blocks=10,
        num_free_kv_blocks=10,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    assert sched.statistics().prefix_cache_hit_rate == 0.0
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = list(range(1, 13))  # three full blocks of 4
    runner = FakeRunner(random.Random(0))
    for rid in ("a", "b"):
        sched.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    stats = sched.statistics()
    # b found a's first two blocks (the last one is recomputed for its logits).
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 12, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 24)
    with pytest.raises(AttributeError):
        stats.num_kv_blocks = 5  # type: ignore[misc]


@pytest.mark.timeout(30)
def test_prefill_tokens_count_prompts_of_one_token_and_not_decodes() -> None:
    sched = _make(num_blocks=20, budget=64, max_seqs=4, policy="fcfs", prefix=False)
    runner = FakeRunner(random.Random(0))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request(EngineCoreRequest("one", [7], params, 0.0))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    assert sched.statistics().num_prefill_tokens == 1
    sched.add_request(EngineCoreRequest("five", [1, 2, 3, 4, 5], params, 0.0))
    for _ in range(6):
        sched.update_from_output(out := sched.schedule(), runner.execute(out))
    assert sched.statistics().num_prefill_tokens == 1 + 5  # the decodes add nothing
