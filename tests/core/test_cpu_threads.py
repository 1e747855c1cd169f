"""ThreadGovernor: compute threads follow what other processes leave of this process's cores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.core import cpu_threads
from asyncengine.core.cpu_threads import ThreadGovernor

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def governor(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ThreadGovernor, list[float]]]:
    """A governor of two cores on a fake clock and /proc: append the other processes' use
    (in cores) for the next interval to the list, then tick."""
    before = torch.get_num_threads()
    others: list[float] = []
    state = {"now": 0.0, "busy": 0.0, "own": 0.0}

    def sample(self: ThreadGovernor) -> tuple[float, float, float]:
        return state["now"], state["busy"], state["own"]

    monkeypatch.setattr(ThreadGovernor, "_sample", sample)
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads.os.path, "exists", lambda path: True)
    gov = ThreadGovernor(2)

    real_tick = gov.tick

    def tick() -> None:
        use = others.pop(0)
        state["now"] += cpu_threads.INTERVAL_S
        state["own"] += 1.0 * cpu_threads.INTERVAL_S  # the engine itself: one core's worth
        state["busy"] += (1.0 + use) * cpu_threads.INTERVAL_S
        real_tick()

    gov.tick = tick  # type: ignore[method-assign]
    yield gov, others
    torch.set_num_threads(before)


def test_a_busy_neighbour_takes_a_core_after_two_readings(
    governor: tuple[ThreadGovernor, list[float]],
) -> None:
    gov, others = governor
    others += [0.0, 1.0, 1.0, 1.0]
    gov.tick()
    assert gov.threads == 2
    gov.tick()  # one reading: not yet (a passing burst)
    assert gov.threads == 2
    gov.tick()
    assert gov.threads == 1 and torch.get_num_threads() == 1
    gov.tick()
    assert gov.threads == 1


def test_the_core_comes_back_and_bursts_do_not_flap(
    governor: tuple[ThreadGovernor, list[float]],
) -> None:
    gov, others = governor
    others += [1.0, 1.0, 0.1, 1.0, 0.2, 0.3]
    for _ in range(2):
        gov.tick()
    assert gov.threads == 1
    gov.tick()  # a quiet reading between busy ones: no change
    gov.tick()
    assert gov.threads == 1
    gov.tick()
    gov.tick()  # quiet twice in a row (light use, below a core's worth): both cores again
    assert gov.threads == 2 and torch.get_num_threads() == 2


def test_it_never_goes_below_one_thread(governor: tuple[ThreadGovernor, list[float]]) -> None:
    gov, others = governor
    others += [3.0, 3.0]
    gov.tick()
    gov.tick()
    assert gov.threads == 1
