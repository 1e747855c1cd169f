"""ThreadGovernor: compute threads follow what other processes leave of this process's cores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


def test_fixed_threads_holds_the_count_and_restores_it() -> None:
    before = torch.get_num_threads()
    with cpu_threads.fixed_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), cpu_threads.fixed_threads(before + 2):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with cpu_threads.fixed_threads(None):
        assert torch.get_num_threads() == before


def _spy_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch's thread count at each model step (ModelRunner.execute_model), in order."""
    from asyncengine.worker.model_runner import ModelRunner

    seen: list[int] = []
    execute = ModelRunner.execute_model

    def spy(self: ModelRunner, *args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return execute(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelRunner, "execute_model", spy)
    return seen


def test_llm_in_process_steps_with_the_users_num_threads(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline LLM runs its model in the caller's thread: num_threads holds there for
    every step, and the caller's own count is back after each call."""
    from asyncengine import LLM, SamplingParams

    seen = _spy_threads(monkeypatch)
    before = torch.get_num_threads()
    want = before + 1  # a count the caller does not have, whatever the machine
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_threads=want)
    try:
        assert torch.get_num_threads() == before
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert seen and set(seen) == {want}
    assert torch.get_num_threads() == before


@pytest.mark.anyio
async def test_async_llm_in_a_thread_steps_with_the_users_num_threads(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncengine import AsyncLLM, SamplingParams

    seen = _spy_threads(monkeypatch)
    want = torch.get_num_threads() + 1
    async with AsyncLLM.from_pretrained(
        tiny_llama, device="cpu", dtype="float32", core="thread", num_threads=want
    ) as engine:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        async for _ in engine.generate([5, 6, 7], params):
            pass
    assert seen and set(seen) == {want}
