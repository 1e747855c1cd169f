"""The data-parallel router's policies, without processes."""

from __future__ import annotations

import pytest

from asyncengine.client.cores.dp_router import Router
from asyncengine.ipc.messages import CoreLoad

pytestmark = pytest.mark.timeout(30)

PREFIX = list(range(100, 148))  # three 16-token blocks


def test_load_routing_picks_the_least_loaded_counting_its_own_sends() -> None:
    router = Router(3, "load", block_size=16, prefix_margin=64)
    router.report(0, CoreLoad(2, 0, 0.1))  # score 8
    router.report(1, CoreLoad(0, 5, 0.1))  # score 5
    router.report(2, CoreLoad(0, 6, 0.1))  # score 6
    assert router.route([1, 2, 3]) == 1
    router.sent(1)  # 5 + 4 = 9 until rank 1 reports again
    assert router.route([1, 2, 3]) == 2
    router.report(1, CoreLoad(0, 1, 0.0))
    assert router.route([1, 2, 3]) == 1


def test_prefix_routing_follows_the_deepest_known_block_within_the_margin() -> None:
    router = Router(2, "prefix", block_size=16, prefix_margin=8)
    first = router.route([*PREFIX, 1])
    router.sent(first)
    other = 1 - first
    # Same three blocks: the same rank, although it is now the busier one (by 4 <= 8).
    assert router.route([*PREFIX, 2]) == first
    # Only the first block shared: still that rank (the deepest known block is block 0).
    assert router.route([*PREFIX[:16], *range(900, 940)]) == first
    # Busier by more than the margin: the least-loaded rank takes it, and owns it from now on.
    router.report(first, CoreLoad(3, 0, 0.5))  # score 12 > 0 + 8
    assert router.route([*PREFIX, 3]) == other
    router.report(first, CoreLoad(0, 0, 0.0))
    assert router.route([*PREFIX, 4]) == other
    # No full block: by load.
    assert router.route([1, 2, 3]) in (0, 1)


def test_dead_ranks_get_nothing() -> None:
    for policy in ("prefix", "load", "round_robin"):
        router = Router(3, policy, block_size=16, prefix_margin=64)
        owner = router.route(PREFIX)
        router.remove(owner)
        picks = {router.route(PREFIX) for _ in range(6)}
        assert owner not in picks and picks <= {0, 1, 2}


def test_round_robin_takes_turns() -> None:
    router = Router(3, "round_robin", block_size=16, prefix_margin=64)
    assert [router.route([1]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.remove(1)
    assert [router.route([1]) for _ in range(4)] == [0, 2, 0, 2]


def test_prefix_routing_keeps_an_adapters_requests_together_and_its_prefixes_apart() -> None:
    router = Router(2, "prefix", block_size=16, prefix_margin=8)
    first = router.route([1, 2, 3], "support")  # no prefix, no owner: the least loaded
    router.sent(first)
    other = 1 - first
    # Another prompt for the same adapter: its rank, though busier (by 4 <= 8).
    assert router.route([7, 8, 9], "support") == first
    router.sent(first)
    assert router.route([4, 5, 6], "billing") == other  # a new adapter: by load
    # The base model's copy of an adapter's prompt is not that adapter's prefix.
    router.sent(other)
    router.sent(other)
    base = router.route([*PREFIX, 1])
    router.sent(base)
    assert router.route([*PREFIX, 2], "support") == first
    # Busier by more than the margin: the least-loaded rank, which owns the adapter from now.
    router.report(first, CoreLoad(4, 0, 0.5))
    router.report(other, CoreLoad(0, 0, 0.0))
    assert router.route([10, 11], "support") == other
    router.report(first, CoreLoad(0, 0, 0.0))
    assert router.route([12, 13], "support") == other
