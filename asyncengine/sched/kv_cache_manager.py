"""KVCacheManager: which KV cache blocks each request owns, and the prefix cache.

The scheduler drives it, per request (vLLM v1 semantics):

1. first scheduling (new or preempted): ``get_computed_blocks`` finds the cached prefix,
   then ``allocate_slots(request, n, computed_blocks)`` takes it together with fresh
   blocks for ``n`` more tokens;
2. later steps: ``allocate_slots(request, n)`` grows the request's blocks;
3. finish, abort or preemption: ``free(request)``.

A full block is identified by a chained hash over its tokens and every token before it,
so equal hashes mean equal KV contents.
"""

from __future__ import annotations

from asyncengine.block_hash import hash_block_tokens
from asyncengine.sched.block_pool import BlockPool, KVCacheBlock
from asyncengine.sched.request import Request


class KVCacheManager:
    """Allocates paged KV cache blocks to requests, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        # request_id -> its blocks, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are registered in the prefix cache
        # (or were deliberately skipped), so each block is cached at most once.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache lookups, counted in tokens: looked up, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0)."""
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and the tokens it covers.

        At least one token is always left to compute (the model must produce logits), so
        at most ``(num_tokens - 1) // block_size`` blocks are returned. Returns ``([], 0)``
        with prefix caching off. Takes no references: pass the blocks to ``allocate_slots``
        for this request before allocating anything else.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        # Hash lazily and stop at the first miss: a long unseen prompt is hashed once, by
        # allocate_slots, as its blocks fill.
        for i in range(max_blocks):
            block = self.block_pool.get_cached_block(self._block_hash(request, i))
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make the request own blocks for ``num_computed_tokens`` + the computed blocks'
        tokens + ``num_new_tokens`` tokens.

        ``new_computed_blocks`` (from ``get_computed_blocks``, on a request that holds no
        blocks) are referenced and become the request's first blocks. Returns the ids of
        the newly allocated blocks (possibly empty), or None when there are not enough free
        blocks, in which case nothing changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id)
        if not computed and req_blocks is not None:
            # The common decode step: the request's last block has room, and no block fills
            # up. The same as the general path below, at a fraction of its cost.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(req_blocks) * self.block_size and (
                not self.enable_prefix_caching
                or min(num_tokens, request.num_tokens) // self.block_size
                <= self.num_cached_blocks.get(request.request_id, 0)
            ):
                return []
        if computed:
            self._check_computed_blocks(request, req_blocks, computed)
        num_held = len(req_blocks) if req_blocks is not None else 0

        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(computed))
        # Computed blocks that are free leave the free queue when touched, so they take
        # from the same budget as fresh blocks.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        # Touch before allocating, so get_new_blocks cannot evict the computed blocks.
        self.block_pool.touch(computed)
        req_blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            num_known = min(num_tokens, request.num_tokens)
            self._cache_full_blocks(request, req_blocks, len(computed), num_known)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Release every block of the request; a no-op if it holds none.

        Blocks are freed tail first, so that its prefix blocks, the ones most likely to be
        shared, are evicted last.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))

    def free_tail(self, request: Request) -> None:
        """Release the request's blocks past the ones its ``num_computed_tokens`` fill
        (speculative decoding's rollback: they hold only rejected drafts). Such blocks were
        never hashed: only blocks full of the request's own tokens are."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-request.num_computed_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        if self.num_cached_blocks.get(request.request_id, 0) > keep:
            raise RuntimeError(f"request {request.request_id}: a cached block past its tokens")
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in token order (its block table row); [] if none."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; blocks in use stay allocated. Returns True."""
        return self.block_pool.reset_prefix_cache()

    def _check_computed_blocks(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        computed: list[KVCacheBlock],
    ) -> None:
        # Cheap guards against scheduler bugs that would silently corrupt KV: computed
        # blocks belong only at the start of a request, and must not have been evicted
        # since get_computed_blocks found them.
        if req_blocks or request.num_computed_tokens:
            raise RuntimeError(
                f"request {request.request_id}: computed blocks given to a request "
                "that already has blocks or computed tokens"
            )
        for i, block in enumerate(computed):
            if i >= len(request.block_hashes) or block.block_hash != request.block_hashes[i]:
                raise RuntimeError(
                    f"request {request.request_id}: computed block {block.block_id} "
                    "was evicted before allocate_slots"
                )

    def _cache_full_blocks(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock],
        num_computed_blocks: int,
        num_known_tokens: int,
    ) -> None:
        """Register the request's blocks that are full once ``num_known_tokens`` are in."""
        rid = request.request_id
        # Computed blocks came from the cache: they are registered already.
        start = max(self.num_cached_blocks.get(rid, 0), num_computed_blocks)
        num_full = num_known_tokens // self.block_size
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], self._block_hash(request, i))
        self.num_cached_blocks[rid] = max(start, num_full)

    def _block_hash(self, request: Request, index: int) -> bytes:
        """The chained hash of the request's full block ``index``, memoised on the request.

        ``request.block_hashes`` stays valid across preemption: tokens are only appended.
        """
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            if (i + 1) * bs > request.num_tokens:
                raise RuntimeError(f"request {request.request_id}: block {i} is not full")
            parent = hashes[-1] if hashes else request.hash_seed
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes[index]
