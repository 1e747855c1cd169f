"""The data-parallel router: which engine-core rank a new request goes to.

Policies (`data_parallel_routing`):

- "load": the least-loaded live rank, by `waiting × 4 + running` (as vLLM: a waiting request
  costs its whole prefill, a running one a decode slot). The load is what each rank last
  published with its outputs, plus the requests this client has sent it since.
- "prefix" (default): the rank that most recently received the same leading full KV blocks
  (hashed as the prefix cache hashes them), so the request finds its prefix cached there;
  unless that rank's load exceeds the least-loaded rank's by more than `prefix_margin`
  (then "load"). Requests with no full block, or no known prefix, go by load; those for a
  LoRA adapter first to the rank that last received one for it (within the same margin), so
  each rank runs few adapters (their per-step slots, `max_loras`, stay free) and finds them
  loaded. An adapter's prefixes are its own (hashed with its name as the seed).
- "round_robin": each live rank in turn.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from asyncengine.block_hash import prompt_block_hashes
from asyncengine.ipc.messages import CoreLoad

ROUTING_POLICIES = ("prefix", "load", "round_robin")
_MAX_PREFIX_ENTRIES = 200_000  # block hashes remembered (LRU), ~30 MB at most
_MAX_HASHED_BLOCKS = 256  # leading blocks a request is hashed over (bounds the client's cost)


class Router:
    """Picks ranks and keeps the per-rank state the policies need; no IO."""

    def __init__(self, size: int, policy: str, *, block_size: int, prefix_margin: int) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing={policy!r}: must be one of {ROUTING_POLICIES}")
        self.size = size
        self.policy = policy
        self.block_size = block_size
        self.prefix_margin = prefix_margin
        self.loads = [CoreLoad(0, 0, 0.0) for _ in range(size)]
        self.in_flight = [0] * size  # requests sent since the rank's last load report
        self.live = set(range(size))
        self._prefix_owner: OrderedDict[bytes, int] = OrderedDict()
        self._adapter_owner: dict[str, int] = {}  # LoRA adapter -> the rank it last went to
        self._turns = itertools.cycle(range(size))

    def score(self, rank: int) -> int:
        load = self.loads[rank]
        return (load.num_waiting_reqs + self.in_flight[rank]) * 4 + load.num_running_reqs

    def route(self, prompt_token_ids: list[int], lora_name: str | None = None) -> int:
        """The rank for a new request (ValueError-free: the caller checks a rank is live)."""
        if self.policy == "round_robin":
            rank = next(r for r in self._turns if r in self.live)
        elif self.policy == "load":
            rank = self._least_loaded()
        else:
            rank = self._by_prefix(prompt_token_ids, lora_name)
        return rank

    def sent(self, rank: int) -> None:
        """A request went to `rank`: count it until the rank's next load report."""
        self.in_flight[rank] += 1

    def report(self, rank: int, load: CoreLoad) -> None:
        """`rank` published its load: it counts every request it has received by now."""
        self.loads[rank] = load
        self.in_flight[rank] = 0

    def remove(self, rank: int) -> None:
        """`rank` is dead: route nothing more to it."""
        self.live.discard(rank)

    def _least_loaded(self) -> int:
        return min(self.live, key=lambda r: (self.score(r), r))

    def _by_prefix(self, prompt_token_ids: list[int], lora_name: str | None = None) -> int:
        seed = b"" if lora_name is None else f"lora\0{lora_name}".encode()
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, _MAX_HASHED_BLOCKS, seed)
        owner: int | None = None
        for block_hash in hashes:  # chained: the deepest known block wins; stop at a miss
            rank = self._prefix_owner.get(block_hash)
            if rank is None:
                break
            owner = rank
        if owner is None and lora_name is not None:
            owner = self._adapter_owner.get(lora_name)
        least = self._least_loaded()
        if owner is None or owner not in self.live:
            rank = least
        elif self.score(owner) - self.score(least) > self.prefix_margin:
            rank = least  # a cached prefix is not worth that much queueing
        else:
            rank = owner
        if lora_name is not None:
            self._adapter_owner[lora_name] = rank
        # This rank now holds (or will, after this prefill) these blocks: remember it.
        for block_hash in hashes:
            self._prefix_owner[block_hash] = rank
            self._prefix_owner.move_to_end(block_hash)
        while len(self._prefix_owner) > _MAX_PREFIX_ENTRIES:
            self._prefix_owner.popitem(last=False)
        return rank
