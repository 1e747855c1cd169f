"""LoRASlots: the scheduler's view of the LoRA adapters: which names exist (with their
prefix-cache salt) and how many distinct adapters one step may run (`max_loras`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from hashlib import blake2b

from asyncengine.sched.request import Request

# How far down the waiting queue a step looks for a request that may run when the one at its
# head waits for an adapter slot (bounded: the scan runs for every request a step admits).
LOOKAHEAD = 256


class LoRASlots:
    """Adapter names the core holds, and the per-step bound on distinct adapters.

    A waiting request whose adapter would be one too many waits for a running adapter's
    requests to finish (it is never refused for that), while requests behind it that can run
    go first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.hash_seeds: dict[str, bytes] = {}  # name -> the first block's parent hash

    def register(self, name: str, path: str) -> None:
        # Salted with the path too: an adapter removed and added again from another folder
        # must not meet the old one's cached prefixes.
        self.hash_seeds[name] = blake2b(f"lora\0{name}\0{path}".encode(), digest_size=16).digest()

    def unregister(self, name: str) -> None:
        self.hash_seeds.pop(name, None)

    def hash_seed(self, name: str | None) -> bytes:
        """The request's first parent hash; ValueError for an adapter name the core lacks."""
        if name is None:
            return b""
        seed = self.hash_seeds.get(name)
        if seed is None:
            known = ", ".join(sorted(self.hash_seeds)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}: the engine holds {known}")
        return seed

    def fits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether `request` may join a step with the `running` requests: its adapter is one
        of theirs, or fewer than max_loras distinct adapters run."""
        if request.lora_name is None:
            return True
        active = {r.lora_name for r in running if r.lora_name is not None}
        return request.lora_name in active or len(active) < self.max_loras

    def first_fitting(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Request | None:
        """The first of `waiting` (in queue order, within the first LOOKAHEAD) that `fits`:
        a request whose adapter must wait for a slot does not hold up the base model's
        requests or those of running adapters behind it (as in vLLM)."""
        active = {r.lora_name for r in running if r.lora_name is not None}
        free = len(active) < self.max_loras
        for request in itertools.islice(waiting, LOOKAHEAD):
            if request.lora_name is None or free or request.lora_name in active:
                return request
        return None

    def in_use(self, name: str, requests: Iterable[Request]) -> bool:
        return any(r.lora_name == name for r in requests)
