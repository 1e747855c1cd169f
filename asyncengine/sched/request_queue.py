"""Waiting-queue policies: first come first served, by priority, or shortest prompt first.

- "fcfs": arrival order.
- "priority": lower `priority` first; ties go to the earlier arrival.
- "sjf": shortest job (prompt) first, aged by arrival. A request ranks by
  `arrival_time + num_prompt_tokens * seconds_per_token`, the time its prefill would end had it
  started on arrival, with `seconds_per_token` measured from the engine's own prefill steps.
  When many requests wait at once (a burst) the short prompts go first, which minimises the
  mean time to first token; a request is overtaken only by later arrivals whose prompts are
  shorter by more than they arrived later (in prefill time), so a long prompt never starves.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from asyncengine.sched.request import Request


class RequestQueue(ABC):
    """The waiting queue; the policy also decides which running request to preempt."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Put back a preempted request so that it is among the first to run again."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """How long the model took for a step of `num_tokens` tokens (most policies ignore it)."""
        del num_tokens, seconds


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]  # the latest admitted


class _RankedQueue(RequestQueue):
    """A heap on `rank(request)` (smaller first; ties by insertion), with lazy removal."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # ids of lazily deleted heap entries

    @abstractmethod
    def rank(self, request: Request) -> tuple[float, ...]: ...

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.rank(request), next(self._counter), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)  # its rank comes from its arrival, so it is still ranked fairly

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._prune()
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        live = (e for e in self._heap if id(e[2]) not in self._removed)
        return (e[2] for e in sorted(live, key=lambda e: (e[0], e[1])))

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.rank)


class PriorityQueue(_RankedQueue):
    """Lower `priority` runs first; ties go to the earlier arrival."""

    def rank(self, request: Request) -> tuple[float, ...]:
        return (request.priority, request.arrival_time)


class ShortestPromptQueue(_RankedQueue):
    """Shortest prompt first, aged by arrival (see the module docstring).

    `seconds_per_token` starts at `initial_seconds_per_token` and then follows the steps the
    engine reports through `observe_step`: an exponential average over steps of at least
    `min_observed_tokens` tokens (smaller steps are mostly decodes, whose cost per token says
    little about a prefill's). A rank is fixed when the request is queued.
    """

    def __init__(
        self, *, min_observed_tokens: int, initial_seconds_per_token: float = 1e-4
    ) -> None:
        super().__init__()
        self.min_observed_tokens = min_observed_tokens
        self.seconds_per_token = initial_seconds_per_token

    def rank(self, request: Request) -> tuple[float, ...]:
        return (request.arrival_time + request.num_prompt_tokens * self.seconds_per_token,)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= self.min_observed_tokens and seconds > 0:
            self.seconds_per_token += 0.25 * (seconds / num_tokens - self.seconds_per_token)


def make_request_queue(policy: str, max_num_batched_tokens: int) -> RequestQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "sjf":
        return ShortestPromptQueue(min_observed_tokens=max(1, max_num_batched_tokens // 4))
    return FCFSQueue()
