"""A CPU step whose products run on the kernels' work pool samples in its own thread alone
(linear_cpu.openmp_in_caller): no OpenMP team is left spinning on the core that the pool's
helper needs next. Larger steps keep every thread; the tokens are the same either way."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.kernels import linear_cpu
from asyncengine.kernels.cpu_native import load_native
from asyncengine.worker import model_runner
from asyncengine.worker.sampler import Sampler

pytestmark = pytest.mark.skipif(load_native() is None, reason="the native kernels are not built")


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever the machine has: OpenMP takes more threads than cores
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(60)
def test_openmp_in_caller_is_one_thread_inside_and_restores_after(two_threads: None) -> None:
    seen_elsewhere: list[int] = []
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        torch.set_num_threads(2)
        inside.wait(10)
        seen_elsewhere.append(torch.get_num_threads())
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with linear_cpu.openmp_in_caller():
        assert torch.get_num_threads() == 1
        inside.set()
        assert done.wait(10)
        with linear_cpu.openmp_in_caller():  # nested: still one, and the outer one restores
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    thread.join(10)
    assert torch.get_num_threads() == 2
    assert seen_elsewhere == [2]  # another thread's setting is its own


@pytest.mark.timeout(120)
def test_small_steps_sample_in_one_thread_with_the_same_tokens(
    two_threads: None, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []  # (rows of logits, torch threads) per sampler call
    forward = Sampler.forward

    def spy(self: Sampler, logits: torch.Tensor, metadata):  # type: ignore[no-untyped-def]
        seen.append((logits.shape[0], torch.get_num_threads()))
        return forward(self, logits, metadata)

    monkeypatch.setattr(Sampler, "forward", spy)
    # A 20-token prompt (one prefill step: more tokens than the pool takes), then decode
    # steps of one token; seeded, so the tokens must not depend on the threads.
    prompt = [(7 * i) % 50 + 3 for i in range(linear_cpu.POOL_MAX_ROWS + 12)]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)

    def tokens() -> list[int]:
        llm = LLM(tiny_llama, device="cpu", dtype="float32")
        try:
            return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()

    with_caller_only = tokens()
    assert seen[0][1] == 2  # the prefill step samples with both threads
    assert [threads for _, threads in seen[1:]] == [1] * 5  # each decode step with one
    assert torch.get_num_threads() == 2  # restored after each

    always_all: Callable[..., object] = lambda self, scheduler_output: nullcontext()  # noqa: E731
    monkeypatch.setattr(model_runner.ModelRunner, "_host_ops", always_all)
    seen.clear()
    assert tokens() == with_caller_only
    assert {threads for _, threads in seen} == {2}
