"""The n-gram (prompt lookup) proposer against a brute-force search of the same rule: the
longest suffix of min_n..max_n tokens that occurs earlier, its latest occurrence, the k tokens
after it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.sched.ngram_proposer import propose

pytestmark = pytest.mark.timeout(60)


def _brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 1, n - 1, -1):  # latest first; end < size: a token follows
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_examples() -> None:
    # "the cat sat on the" -> "cat sat on"
    tokens = [1, 2, 3, 4, 1]
    assert propose(tokens, 3, 1, 3) == [2, 3, 4]
    assert propose([1, 2, 3, 9, 1, 2, 7, 1, 2], 2, 1, 2) == [7, 1]  # the latest of two
    assert propose([1, 2, 3, 9, 2, 3, 1, 2, 3], 2, 1, 3) == [9, 2]  # longest wins: [1, 2, 3]
    assert propose([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert propose([4, 4, 4, 4], 3, 2, 2) == [4]  # overlapping runs; ends at the sequence end
    assert propose([1, 2, 1], 0, 1, 2) == []
    assert propose([1], 3, 1, 2) == []
    assert propose([1, 2, 3, 1, 2], 5, 3, 4) == []  # below min_n
    # The search runs over the tokens' bytes: a match across two tokens' bytes is none.
    assert propose([0, 1, 5, 1 << 56], 2, 1, 1) == []
    assert propose([0, 1, 1 << 56, 7, 1 << 56], 2, 1, 1) == [7, 1 << 56]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([0, 1, 256, 1 << 8, 1 << 56, 2**40 + 1]), max_size=30),
    k=st.integers(1, 4),
    min_n=st.integers(1, 3),
)
def test_large_ids_match_only_whole_tokens(tokens: list[int], k: int, min_n: int) -> None:
    assert propose(tokens, k, min_n, min_n + 1) == _brute(tokens, k, min_n, min_n + 1)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        propose([1, 2], 1, 3, 2)
    with pytest.raises(ValueError, match="1 <= prompt_lookup_min"):
        propose([1, 2], 1, 0, 2)


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(0, 5),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_equals_the_brute_force_search(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    assert propose(tokens, k, min_n, max_n) == _brute(tokens, k, min_n, max_n)
