"""Waiting-queue policies: first come first served, or by priority (lower value first)."""

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

    @staticmethod
    @abstractmethod
    def pick_victim(running: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""


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

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return running[-1]  # the latest admitted


class PriorityQueue(RequestQueue):
    """Lower `priority` runs first; ties go to the earlier arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # ids of lazily deleted heap entries

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def add_preempted(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) key already ranks it fairly

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._prune()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if id(e[3]) not in self._removed)

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "priority":
        return PriorityQueue()
    return FCFSQueue()
