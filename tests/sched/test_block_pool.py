"""BlockPool and its free queue: allocation, reference counts, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.sched.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_starts_in_id_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]


def test_free_queue_popleft_remove_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    queue.remove(blocks[4])  # the tail
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 0]
    assert queue.num_free_blocks == 3
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None


def test_free_queue_empty_and_misuse() -> None:
    blocks = [KVCacheBlock(0)]
    queue = FreeKVCacheBlockQueue(blocks)
    block = queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(block)  # not in the queue
    queue.append(block)
    with pytest.raises(RuntimeError):
        queue.append(block)  # already in the queue


def test_get_new_blocks_takes_from_head_with_one_ref() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # the failed call took nothing


def test_free_appends_cached_blocks_to_tail_in_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for block in blocks:
        pool.cache_full_block(block, bytes([block.block_id]))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    assert pool.usage == 0.0


def test_uncached_blocks_are_reused_before_cached_ones_are_evicted() -> None:
    """A freed block without a hash goes to the head, most recently freed first: it is the
    next taken (still resident), and no cached block is evicted while one is free."""
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(a, b"h-a")
    pool.free_blocks([a, b, c])  # a cached: tail; b, then c: head
    assert free_ids(pool) == [2, 1, 4, 0]
    assert pool.get_new_blocks(3) == [c, b, pool.blocks[4]]
    assert pool.get_cached_block(b"h-a") is a  # still cached: three others went first
    assert d.ref_cnt == 1


def test_reset_prefix_cache_moves_freed_cached_blocks_to_the_head() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for block in blocks:
        pool.cache_full_block(block, bytes([block.block_id]))
    pool.free_blocks(blocks)  # tail: 0, 1, 2 (2 the most recently freed)
    assert free_ids(pool) == [3, 0, 1, 2]
    pool.reset_prefix_cache()
    assert free_ids(pool) == [2, 1, 0, 3]  # reused before the never-written block 3
    assert all(block.block_hash is None for block in pool.blocks)


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_touch_revives_free_block_and_shares_used_block() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2
    pool.touch([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    assert free_ids(pool) == [2]
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1  # still held once


def test_cached_free_block_is_evicted_on_reuse() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h-a")
    pool.cache_full_block(b, b"h-b")
    pool.free_blocks([a, b])
    assert pool.get_cached_block(b"h-a") is a  # free but still cached
    [c] = pool.get_new_blocks(1)
    assert c is a
    assert c.block_hash is None
    assert pool.get_cached_block(b"h-a") is None
    assert pool.get_cached_block(b"h-b") is b


def test_cache_full_block_keeps_existing_mapping() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"same")
    pool.cache_full_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # evicts b, which must not drop a's mapping
    assert pool.get_cached_block(b"same") is a


def test_reset_prefix_cache_drops_every_hash() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h-a")
    pool.cache_full_block(b, b"h-b")
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert a.block_hash is None and b.block_hash is None
    assert a.ref_cnt == 1  # blocks in use stay allocated
    assert pool.num_free_blocks == 2


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["get", "free", "touch"]), st.integers(0, 7))))
def test_pool_accounting_under_random_ops(ops: list[tuple[str, int]]) -> None:
    """The free queue holds exactly the blocks with ref 0, whatever the op sequence."""
    pool = BlockPool(8)
    for op, arg in ops:
        used = [b for b in pool.blocks if b.ref_cnt > 0]
        if op == "get" and arg <= pool.num_free_blocks:
            pool.get_new_blocks(arg)
        elif op == "free" and used:
            pool.free_blocks([used[arg % len(used)]])
        elif op == "touch":
            pool.touch([pool.blocks[arg]])
        free = pool.free_block_queue.get_all_free_blocks()
        assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert len(free) == pool.num_free_blocks
