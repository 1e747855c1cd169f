"""KVCacheManager: block allocation, prefix-cache hits, LRU eviction, preemption."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import asyncengine.sched.kv_cache_manager as kvm
from asyncengine.block_hash import hash_block_tokens
from asyncengine.sampling_params import SamplingParams
from asyncengine.sched.block_pool import KVCacheBlock
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.request import Request


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(),
        arrival_time=0.0,
        all_token_ids=list(token_ids),
    )


def chain_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The expected hash of every full block, computed independently of the manager."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def schedule(mgr: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int]:
    """What the scheduler does for one step: allocate, then (after the forward) advance."""
    computed: list[KVCacheBlock] = []
    num_hit = 0
    if req.num_computed_tokens == 0 and not mgr.get_block_ids(req.request_id):
        computed, num_hit = mgr.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - req.num_computed_tokens - num_hit
    new_ids = mgr.allocate_slots(req, num_new_tokens, computed)
    assert new_ids is not None
    req.num_computed_tokens += num_hit + num_new_tokens
    return new_ids


def preempt(mgr: KVCacheManager, req: Request) -> None:
    mgr.free(req)
    req.num_computed_tokens = 0


# --- allocation -------------------------------------------------------------------------


def test_allocate_grows_blocks_as_tokens_arrive() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(10)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    assert mgr.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert mgr.num_free_blocks == 7
    assert mgr.usage == pytest.approx(0.3)
    req.append_output_token(100)  # 11 tokens: still fits in block 2
    assert mgr.allocate_slots(req, 1) == []
    req.num_computed_tokens = 11
    req.append_output_token(101)
    assert mgr.allocate_slots(req, 1) == []
    req.num_computed_tokens = 12
    req.append_output_token(102)  # the 13th token needs a fourth block
    assert mgr.allocate_slots(req, 1) == [3]
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]


def test_chunked_prefill_allocates_per_chunk() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(10)))
    assert schedule(mgr, req, 3) == [0]
    assert schedule(mgr, req, 3) == [1]
    assert schedule(mgr, req, 4) == [2]
    assert req.block_hashes == chain_hashes(req.all_token_ids, 4)  # two full blocks


def test_free_returns_every_block_and_is_idempotent() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(9)))
    schedule(mgr, req)
    mgr.free(req)
    mgr.free(req)
    mgr.free(make_request("never-seen", [1]))
    assert mgr.num_free_blocks == 8
    assert mgr.get_block_ids("a") == []


def test_allocate_none_when_out_of_blocks_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(12)))
    assert mgr.allocate_slots(req, 12) is None
    assert mgr.get_block_ids("a") == []
    assert mgr.num_free_blocks == 2
    assert req.block_hashes == []


def test_free_cached_blocks_count_against_budget() -> None:
    """Reviving a free cached block takes it from the free queue: allocate must count it,
    and refuse without taking references or evicting anything."""
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4])
    schedule(mgr, a)
    mgr.free(a)  # blocks 0 and 1: free, still cached
    x = make_request("x", [9, 9, 8, 8])
    schedule(mgr, x)  # blocks 2 and 3
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    computed, num_hit = mgr.get_computed_blocks(b)
    assert ([blk.block_id for blk in computed], num_hit) == ([0, 1], 4)
    cache_before = dict(mgr.block_pool.cached_block_hash_to_block)
    refs_before = [blk.ref_cnt for blk in mgr.block_pool.blocks]
    # 2 new blocks + 2 revived > 2 free, although 2 new alone would fit.
    assert mgr.allocate_slots(b, 3, computed) is None
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks] == refs_before
    assert mgr.block_pool.cached_block_hash_to_block == cache_before
    assert [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()] == [1, 0]
    assert mgr.get_block_ids("b") == []
    # Once x is gone, b fits and gets a's blocks back.
    mgr.free(x)
    assert mgr.allocate_slots(b, 3, computed) == [3, 2]
    assert mgr.get_block_ids("b") == [0, 1, 3, 2]


# --- prefix caching ---------------------------------------------------------------------


def test_shared_prefix_hits_and_shares_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    schedule(mgr, a)
    b = make_request("b", [*range(8), 50, 51, 52])
    computed, num_hit = mgr.get_computed_blocks(b)
    assert [blk.block_id for blk in computed] == [0, 1]
    assert num_hit == 8
    assert all(blk.ref_cnt == 1 for blk in computed)  # lookup takes no references
    assert mgr.allocate_slots(b, 3, computed) == [3]
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (12 + 11, 8)
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free_blocks == 10


def test_hit_never_covers_the_whole_prompt() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    schedule(mgr, make_request("a", list(range(12))))
    same = make_request("same", list(range(12)))
    computed, num_hit = mgr.get_computed_blocks(same)
    assert (len(computed), num_hit) == (2, 8)  # the last block is recomputed for logits
    longer = make_request("longer", list(range(13)))
    assert mgr.get_computed_blocks(longer)[1] == 12


def test_prefix_caching_off() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    schedule(mgr, make_request("a", list(range(12))))
    b = make_request("b", list(range(12)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.prefix_cache_hits == 0  # and no hit rate: nothing is looked up


def test_block_hashes_are_chained_and_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def counting(parent: bytes, token_ids: list[int]) -> bytes:
        nonlocal calls
        calls += 1
        return hash_block_tokens(parent, token_ids)

    monkeypatch.setattr(kvm, "hash_block_tokens", counting)
    mgr = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(14)))
    mgr.get_computed_blocks(req)  # a miss on block 0 hashes only block 0
    assert calls == 1
    while req.num_computed_tokens < 14:
        schedule(mgr, req, 3)
    for token in range(6):  # decode across two block boundaries
        req.append_output_token(token)
        schedule(mgr, req, 1)
    assert req.block_hashes == chain_hashes(req.all_token_ids, 4)
    assert calls == 5  # 20 tokens: 5 full blocks, each hashed once
    preempt(mgr, req)
    schedule(mgr, req)  # rescheduled after preemption: no hashing again
    assert calls == 5


def test_first_block_hash_format() -> None:
    import struct
    from hashlib import blake2b

    expected = blake2b(struct.pack("<2q", 7, -1), digest_size=16).digest()
    assert hash_block_tokens(b"", [7, -1]) == expected


def test_concurrent_identical_prompts_keep_first_mapping() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    assert mgr.get_computed_blocks(a)[1] == 0
    assert mgr.get_computed_blocks(b)[1] == 0  # both miss: neither is computed yet
    schedule(mgr, a, 9)
    schedule(mgr, b, 9)
    cache = mgr.block_pool.cached_block_hash_to_block
    assert {h: blk.block_id for h, blk in cache.items()} == dict(
        zip(chain_hashes(list(range(9)), 4), [0, 1], strict=True)
    )
    mgr.free(a)
    mgr.free(b)
    c = make_request("c", list(range(9)))
    assert [blk.block_id for blk in mgr.get_computed_blocks(c)[0]] == [0, 1]


def test_preempted_request_gets_its_own_blocks_back() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(10)))
    schedule(mgr, req)
    req.append_output_token(99)
    before = mgr.get_block_ids("a")
    preempt(mgr, req)
    assert mgr.num_free_blocks == 10
    computed, num_hit = mgr.get_computed_blocks(req)
    assert (num_hit, [blk.block_id for blk in computed]) == (8, before[:2])
    assert mgr.allocate_slots(req, 3, computed) is not None


def test_computed_blocks_evicted_before_allocate_is_an_error() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3])
    schedule(mgr, a)
    mgr.free(a)
    b = make_request("b", [1, 2, 3])
    computed, _ = mgr.get_computed_blocks(b)
    schedule(mgr, make_request("x", [5, 6, 7, 8, 9, 10]))  # evicts a's cached block
    with pytest.raises(RuntimeError):
        mgr.allocate_slots(b, 1, computed)


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    schedule(mgr, a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_block_ids("a") == [0, 1, 2]  # still owned
    assert mgr.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)
    mgr.free(a)
    assert mgr.num_free_blocks == 10


# --- eviction order ---------------------------------------------------------------------


def test_eviction_takes_tail_blocks_before_prefix_blocks() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    schedule(mgr, a)  # blocks 0, 1, 2, all full and cached
    mgr.free(a)
    free = mgr.block_pool.free_block_queue.get_all_free_blocks()
    assert [blk.block_id for blk in free] == [3, 4, 5, 2, 1, 0]
    # Four fresh blocks: the three never-used ones, then a's tail block.
    schedule(mgr, make_request("x", [9, 9, 9, 9, 9, 9, 9, 9]))
    again = make_request("a2", [1, 2, 3, 4, 5, 6, 7])
    computed, num_hit = mgr.get_computed_blocks(again)
    assert ([blk.block_id for blk in computed], num_hit) == ([0, 1], 4)


def test_eviction_is_least_recently_freed_first() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 1, 0])
    b = make_request("b", [2, 2, 0])
    schedule(mgr, a)  # blocks 0, 1 (block 0 full and cached)
    schedule(mgr, b)  # blocks 2, 3
    mgr.free(b)
    mgr.free(a)  # b's cached block was freed first: it is evicted first
    # Three blocks: the two uncached ones (1 and 3, reused before any eviction), then b's.
    schedule(mgr, make_request("x", [7, 7, 7, 7, 7]))
    assert mgr.get_computed_blocks(make_request("b2", [2, 2, 0]))[1] == 0
    assert mgr.get_computed_blocks(make_request("a2", [1, 1, 0]))[1] == 2


# --- property test: random request lifecycles -------------------------------------------

MAX_TOKENS = 20  # a request finishes once it has this many tokens
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # tiny vocab: many shared prefixes


class KVCacheMachine(RuleBasedStateMachine):
    """Requests arrive (often sharing prefixes), prefill in random chunks, decode, get
    preempted or finish. A shadow KV cache records what each slot holds (the token prefix
    whose K/V it stores), so every prefix hit is checked for the right contents."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=1, block_size=1, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.running: set[str] = set()  # requests holding blocks
        self.slots: dict[int, dict[int, tuple[int, ...]]] = {}  # block id -> offset -> prefix
        self.next_id = 0

    @initialize(
        block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12), caching=st.booleans()
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, caching)

    def _new(self, token_ids: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.live[rid] = make_request(rid, token_ids)

    def _pick(self, index: int, pool: list[str]) -> Request:
        return self.live[sorted(pool)[index % len(pool)]]

    @rule(token_ids=tokens)
    def add(self, token_ids: list[int]) -> None:
        self._new(token_ids)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), cut=st.integers(0, 16), suffix=tokens)
    def fork(self, index: int, cut: int, suffix: list[int]) -> None:
        parent = self._pick(index, list(self.live))
        self._new(parent.all_token_ids[:cut] + suffix)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 9), sampled=st.integers(0, 2))
    def step_one(self, index: int, chunk: int, sampled: int) -> None:
        self._step(self._pick(index, list(self.live)), chunk, sampled)

    @precondition(lambda self: self.live)
    @rule(chunk=st.integers(1, 9), sampled=st.integers(0, 2))
    def step_all(self, chunk: int, sampled: int) -> None:
        """A scheduler step: every request in turn, as many as the blocks allow."""
        for rid in sorted(self.live):
            if rid in self.live:  # not finished earlier in this step
                self._step(self.live[rid], chunk, sampled)

    def _step(self, req: Request, chunk: int, sampled: int) -> None:
        bs = self.mgr.block_size
        computed: list[KVCacheBlock] = []
        num_hit = 0
        if req.request_id not in self.running:
            assert req.num_computed_tokens == 0
            computed, num_hit = self.mgr.get_computed_blocks(req)
            assert num_hit == len(computed) * bs < req.num_tokens
            for i, blk in enumerate(computed):  # a hit holds exactly this request's prefix
                for off in range(bs):
                    pos = i * bs + off
                    assert self.slots[blk.block_id][off] == tuple(req.all_token_ids[: pos + 1])
        num_new = min(chunk, req.num_tokens - num_hit - req.num_computed_tokens)
        before = self._snapshot()
        new_ids = self.mgr.allocate_slots(req, num_new, computed)
        if new_ids is None:
            assert self._snapshot() == before
            if req.request_id in self.running:  # out of blocks: preempt, as the scheduler does
                self._preempt(req)
            return
        self.running.add(req.request_id)
        for block_id in new_ids:
            self.slots[block_id] = {}  # a fresh block holds garbage
        # The forward pass writes K/V for the new tokens, into private blocks only.
        blocks = self.mgr.block_pool.blocks
        block_ids = self.mgr.get_block_ids(req.request_id)
        start = req.num_computed_tokens + num_hit
        for pos in range(start, start + num_new):
            block_id = block_ids[pos // bs]
            assert blocks[block_id].ref_cnt == 1
            assert pos % bs not in self.slots[block_id]
            self.slots[block_id][pos % bs] = tuple(req.all_token_ids[: pos + 1])
        req.num_computed_tokens = start + num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(sampled)
            if req.num_tokens >= MAX_TOKENS:
                self._finish(req)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index: int) -> None:
        self._preempt(self._pick(index, list(self.running)))

    def _preempt(self, req: Request) -> None:
        preempt(self.mgr, req)
        self.running.discard(req.request_id)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        self._finish(self._pick(index, list(self.live)))

    def _finish(self, req: Request) -> None:
        self.mgr.free(req)
        self.mgr.free(req)  # idempotent
        del self.live[req.request_id]
        self.running.discard(req.request_id)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.mgr.reset_prefix_cache() is True

    def _snapshot(self) -> object:
        pool = self.mgr.block_pool
        return (
            [(blk.ref_cnt, blk.block_hash) for blk in pool.blocks],
            [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()],
            {h: blk.block_id for h, blk in pool.cached_block_hash_to_block.items()},
            {rid: self.mgr.get_block_ids(rid) for rid in self.live},
            dict(self.mgr.num_cached_blocks),
            {rid: list(req.block_hashes) for rid, req in self.live.items()},
        )

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders: Counter[int] = Counter()
        for rid in self.live:
            ids = self.mgr.get_block_ids(rid)
            assert len(ids) == len(set(ids))
            assert (rid in self.running) == bool(ids)
            holders.update(ids)
        assert set(self.mgr.req_to_blocks) == self.running
        for blk in self.mgr.block_pool.blocks:
            assert blk.ref_cnt == holders[blk.block_id]

    @invariant()
    def free_queue_is_exactly_the_unreferenced_blocks(self) -> None:
        pool = self.mgr.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == len({blk.block_id for blk in free}) == self.mgr.num_free_blocks
        assert all(blk.ref_cnt == 0 for blk in free)
        assert len(free) == sum(blk.ref_cnt == 0 for blk in pool.blocks)
        assert self.mgr.usage == pytest.approx(1 - len(free) / pool.num_blocks)

    @invariant()
    def cache_map_is_consistent_with_contents(self) -> None:
        pool = self.mgr.block_pool
        bs = self.mgr.block_size
        for block_hash, blk in pool.cached_block_hash_to_block.items():
            assert blk.block_hash == block_hash
            prefix = self.slots[blk.block_id][bs - 1]  # the block is full and written
            assert chain_hashes(list(prefix), bs)[-1] == block_hash
        assert sum(blk.block_hash is not None for blk in pool.blocks) == len(
            pool.cached_block_hash_to_block
        )

    @invariant()
    def requests_see_their_own_tokens(self) -> None:
        bs = self.mgr.block_size
        for rid in self.running:
            req = self.live[rid]
            ids = self.mgr.get_block_ids(rid)
            assert len(ids) == -(-req.num_computed_tokens // bs)
            for pos in range(req.num_computed_tokens):
                assert self.slots[ids[pos // bs]][pos % bs] == tuple(req.all_token_ids[: pos + 1])
        for req in self.live.values():
            expected = chain_hashes(req.all_token_ids, bs)
            assert req.block_hashes == expected[: len(req.block_hashes)]

    def teardown(self) -> None:
        for req in self.live.values():
            self.mgr.free(req)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        assert all(blk.ref_cnt == 0 for blk in self.mgr.block_pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None
)
