"""BlockPool: every KV cache block, the LRU free queue, and the prefix-cache map.

A block is in exactly one of two states:

- in use: ``ref_cnt > 0``, held by that many running requests, not in the free queue;
- free: ``ref_cnt == 0``, in the free queue. A free block may still hold a cached full
  block (``block_hash`` set): it can be revived by a prefix-cache hit until it is
  reallocated, at which point its hash is evicted.

The free queue is ordered by allocation priority, popped from the head. A freed block that
holds a cached block goes to the tail, so the least recently freed cached block is evicted
first (LRU). A freed block without one (a partial last block, or any block with prefix
caching off or just reset) goes to the head: its contents are worth nothing, so it is reused
before any cached block is evicted, and the most recently freed first, while its pages are
resident and warm (the CPU's KV cache is committed page by page as blocks are first written).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of KV cache slots (``block_size`` tokens of every layer)."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache: then
    # ``cached_block_hash_to_block[block_hash] is self``.
    block_hash: bytes | None = None
    # Free-queue links; both are None exactly when the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, remove and append.

    A plain deque cannot remove from the middle in O(1), which a prefix-cache hit on a
    free block needs. The links live on the blocks themselves, so nothing is allocated.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Sentinels remove every empty-list special case from the link updates.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the next block to evict); ValueError when empty."""
        first = self._head.next_free_block
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, wherever it is in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (the last to be evicted)."""
        last = self._tail.prev_free_block
        assert last is not None
        self._link(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (the next to be taken)."""
        self._link(self._head, block)

    def _link(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free_block
        assert nxt is not None
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) first. O(n): for tests and debugging."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns every block: allocation, reference counting, the LRU free queue and the
    prefix-cache map from a full block's chained hash to the block holding it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0); free cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the free-queue head, each with ``ref_cnt`` 1.

        A popped block that still held a cached block loses it (LRU eviction).
        Raises ValueError when fewer blocks are free: callers check first.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving it from the free queue if free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Cached blocks reaching 0 go to the free-queue
        tail in the given order, so the first of ``ordered_blocks`` is evicted first;
        uncached ones go to the head, to be reused before any cached block is evicted.

        Freeing a block that is already free is a bug and raises RuntimeError.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed while already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the full block with this chained hash, if still cached."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register ``block`` (now full) under ``block_hash``.

        If another block already holds the same hash, that mapping is kept and ``block``
        stays unregistered: two requests computed the same block concurrently, and either
        copy serves later hits equally well.
        """
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (in use or free). Blocks in use stay allocated.

        Returns True (the reset always succeeds; a bool for API parity with vLLM). The free
        blocks that were cached move to the head of the free queue, the most recently freed
        first: like any uncached free block, they are the next to be reused.
        """
        queue = self.free_block_queue
        for block in queue.get_all_free_blocks():  # head (least recently freed) first
            if block.block_hash is not None:
                queue.remove(block)
                queue.appendleft(block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
