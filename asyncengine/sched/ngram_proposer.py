"""n-gram (prompt lookup) drafts for speculative decoding (sched/spec_decode.py): the tokens
that followed the last occurrence of a request's most recent tokens, earlier in its own prompt
and output (vLLM's `ngram` method, llama.cpp's lookup decoding).

`propose(tokens, k, min_n, max_n)` looks for the longest suffix of `tokens` of `max_n` down to
`min_n` tokens that occurs earlier in `tokens`, takes its latest earlier occurrence, and returns
up to `k` tokens that followed it (fewer where the sequence ends first; none without a match).
A later occurrence is preferred: in code, JSON and documents being edited the most recent
context is the likeliest to repeat.

The search is one pass of the Knuth-Morris-Pratt failure function over the reversed sequence:
for every position it gives the longest run ending there that equals a suffix of the whole
sequence, so all suffix lengths are matched at once, O(len(tokens)) time and memory, and a
request's drafts cost microseconds next to a model step.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for `tokens` (a request's prompt and output so far): what
    followed the latest earlier occurrence of its longest suffix of `min_n` to `max_n` tokens
    (see the module docstring); [] where no suffix of `min_n` tokens occurs earlier."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
    size = len(tokens)
    if k <= 0 or size <= min_n:
        return []
    # On the reversed sequence r (r[x] = tokens[size - 1 - x]) a suffix of `tokens` is a
    # prefix of r. KMP's failure function pi[i] is the longest proper prefix of r that ends at
    # i: r[i - L + 1 : i + 1] == r[:L] for L = pi[i]. Back in `tokens`, that is an earlier run
    # tokens[size - 1 - i : end], end = size - 1 - i + L (< size, as L <= i), equal to the
    # last L tokens; so are the last L' < L tokens of that run, with the same end. The match
    # at end is thus min(L, max_n) tokens long, and the tokens that followed it start at end.
    reverse = [tokens[size - 1 - i] for i in range(size)]
    pi = [0] * size
    for i in range(1, size):
        j = pi[i - 1]
        while j and reverse[i] != reverse[j]:
            j = pi[j - 1]
        if reverse[i] == reverse[j]:
            j += 1
        pi[i] = j
    best_len, best_end = 0, -1  # the longest match (capped at max_n), and its latest end
    for i in range(1, size):
        length = min(pi[i], max_n)
        end = size - 1 - i + pi[i]
        if length >= min_n and (length > best_len or (length == best_len and end > best_end)):
            best_len, best_end = length, end
    if best_len < min_n:
        return []
    return list(tokens[best_end : best_end + k])
