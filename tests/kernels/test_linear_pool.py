"""linear.c's products on the work pool (csrc/pool.c): the caller never waits for a helper that
is not running, and nothing depends on who computed what.

A test hook makes every helper sleep after it claims an item, as a preempted thread would: the
caller then takes those items over, and the helper's late result must be dropped, not stored
over the caller's, not added to the residual a second time, not written into the next call's
memory. The numbers must be those of the caller alone, bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels import linear_cpu
from asyncengine.kernels.cpu_native import load_native

LIB = load_native()
pytestmark = pytest.mark.skipif(
    LIB is None or not LIB.linear_bf16_fast or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="the native kernel's fast path is not built (AVX512-BF16)",
)


def _linear(n: int, k: int, seed: int) -> linear_cpu.LinearCpu:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    layer = linear_cpu.prepare_linear_cpu(weight, bias, packed)
    assert layer is not None
    return layer


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a master and one helper, whatever the machine has
    yield
    torch.set_num_threads(before)


@pytest.fixture
def preempted_helpers(threads: None) -> Iterator[None]:
    """Helpers sleep 0.3 ms after each claim (the caller waits for one a few microseconds)."""
    linear_cpu.delay_pool_helpers(300_000)
    yield
    linear_cpu.delay_pool_helpers(0)


def _alone(fn):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(120)
def test_items_a_helper_holds_are_taken_over_with_the_same_numbers(
    preempted_helpers: None,
) -> None:
    layer = _linear(8192, 256, seed=1)  # 128 column blocks: 128 items per call
    g = torch.Generator().manual_seed(2)
    taken = 0
    for rows in (1, 3, 8):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        want = _alone(lambda: layer(x))  # noqa: B023
        for _ in range(30):
            got = layer(x)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows
        # The hook did what it is for: a helper claimed items and the caller took them over
        # (how soon a helper wakes is up to the machine, so call until it has happened).
        for _ in range(2000):
            taken += linear_cpu.delay_pool_helpers(300_000)
            if taken:
                break
            got = layer(x)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows
    assert taken > 0


@pytest.mark.timeout(120)
def test_fused_kernels_commit_each_item_once(preempted_helpers: None) -> None:
    hidden, inter = 256, 512
    up = _linear(2 * inter, hidden, seed=3)  # [gate; up]: 8 block pairs
    down = _linear(hidden, inter, seed=4)  # 4 blocks, then the norm's rows
    norm = torch.randn(hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    for rows in (1, 5, 16):
        x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        residual = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        act_want = _alone(lambda: up.silu_mul(x))  # noqa: B023
        res_want = residual.clone()
        out_want = _alone(lambda: down.add_rms_norm(act_want, res_want, norm, 1e-5))  # noqa: B023
        for _ in range(50):
            act = up.silu_mul(x)
            assert torch.equal(act.view(torch.int16), act_want.view(torch.int16)), rows
            res = residual.clone()
            out = down.add_rms_norm(act, res, norm, 1e-5)
            # residual += product exactly once per row, however many threads computed it
            assert torch.equal(res.view(torch.int16), res_want.view(torch.int16)), rows
            assert torch.equal(out.view(torch.int16), out_want.view(torch.int16)), rows


@pytest.mark.timeout(120)
def test_two_callers_at_once(threads: None) -> None:
    # One thread holds the pool, the other runs its product alone: both exact.
    layer = _linear(1024, 128, seed=7)
    g = torch.Generator().manual_seed(8)
    inputs = [torch.randn(2, 128, generator=g).to(torch.bfloat16) for _ in range(2)]
    wants = [_alone(lambda x=x: layer(x)) for x in inputs]
    errors: list[str] = []

    def run(i: int) -> None:
        for _ in range(300):
            got = layer(inputs[i])
            if not torch.equal(got.view(torch.int16), wants[i].view(torch.int16)):
                errors.append(f"caller {i}: a different product")
                return

    callers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert not errors


@pytest.mark.timeout(120)
def test_quiesce_waits_for_a_helper_still_inside_an_item(preempted_helpers: None) -> None:
    """A helper asleep in an item after the call returned (taken over by the caller) still
    counts as inside it: quiesce waits for it, so memory the item reads may then be freed."""
    assert LIB is not None
    # A product long enough (about a millisecond) that a helper woken for it gets to claim an
    # item even where another process holds the other core for a while.
    layer = _linear(32768, 256, seed=3)
    x = torch.randn(1, 256).to(torch.bfloat16)
    strict = linear_cpu.set_pool_strict(False)  # jobs return before their helpers leave
    linear_cpu.delay_pool_helpers(200_000_000)  # 0.2 s: the call returns long before
    busy = False
    deadline = time.monotonic() + 30
    # until a helper has claimed an item (when it wakes is the machine's)
    while time.monotonic() < deadline:
        layer(x)
        if LIB.pool_quiesce(0) == 0:  # a helper is inside an item right after the call
            busy = True
            break
        time.sleep(0.001)
    linear_cpu.delay_pool_helpers(0)
    assert busy
    assert LIB.pool_quiesce(5000) == 1  # and it leaves it
    linear_cpu.quiesce_pool()
    linear_cpu.set_pool_strict(strict)


def test_strict_jobs_return_with_no_helper_inside_an_item(preempted_helpers: None) -> None:
    """Strict mode (the test suite's): a job returns only once its helpers are out of it."""
    layer = _linear(8192, 256, seed=4)
    x = torch.randn(1, 256).to(torch.bfloat16)
    strict = linear_cpu.set_pool_strict(True)
    try:
        for _ in range(50):
            layer(x)
            assert LIB is not None and LIB.pool_quiesce(0) == 1
    finally:
        linear_cpu.set_pool_strict(strict)
