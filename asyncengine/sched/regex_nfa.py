"""A Python regular expression as a small NFA over sets of characters, for writing it as a
right-linear grammar (one rule per state).

Python's reading of a pattern, because `jsonschema` checks `pattern` with Python's `re`: the
parse is `re`'s own (a private module, public as `sre_parse` before 3.11 and deprecated
since; stable in practice, typed here as Any for want of stubs). Where a class is too large
to list (Python's Unicode `\\d`, `\\w`, `\\s`), the NFA takes a subset: the ASCII members of a
category, and, for its negation or a negated class holding it, only ASCII characters. The
language only shrinks; every string the NFA accepts, `re.fullmatch` accepts too.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    _sre: Any = importlib.import_module("re._parser")
    _sre_c: Any = importlib.import_module("re._constants")
except ImportError:  # Python 3.10
    _sre = importlib.import_module("sre_parse")
    _sre_c = importlib.import_module("sre_constants")

# Sorted, disjoint, inclusive ranges of code points.
CharSet = list[tuple[int, int]]
MAX_CODE_POINT = 0x10FFFF
ALL: CharSet = [(0, MAX_CODE_POINT)]
# What the Thompson construction may build before epsilons go, per final state allowed.
_BUILD_FACTOR = 8


class PatternError(ValueError):
    """The pattern is invalid, or uses something an NFA here cannot express; the message
    names it."""


class NfaTooLarge(PatternError):
    """The NFA would need more states than allowed (bounded repetitions are unrolled)."""


@dataclass(slots=True)
class Nfa:
    """States 0..n-1, 0 the start; `edges[s]` maps a target state to the characters that
    lead there. Every state is reachable and can reach an accepting one."""

    edges: list[dict[int, CharSet]]
    accepting: set[int]


def parse(pattern: str) -> tuple[Any, int, int | None]:
    """`re`'s parse of `pattern`, and its shortest and longest match (None: unbounded)."""
    try:
        parsed = _sre.parse(pattern)
    except re.error as exc:
        raise PatternError(f"pattern {pattern!r} is not a valid regex: {exc}") from None
    low, high = parsed.getwidth()
    return parsed, low, None if high >= _sre_c.MAXREPEAT else high


def pattern_nfa(pattern: str, max_states: int) -> Nfa:
    """The NFA of the strings that fully match `pattern` (its anchors at its ends)."""
    parsed, _, _ = parse(pattern)
    flags = int(parsed.state.flags)
    if flags & (re.IGNORECASE | re.LOCALE):
        raise PatternError(f"pattern {pattern!r}: case-insensitive matching is not supported")
    builder = _Builder(pattern, max_states * _BUILD_FACTOR)
    start = builder.state()
    end = builder.sequence(list(parsed), start, True, True, bool(flags & re.DOTALL))
    return builder.finish(start, end, max_states)


class _Builder:
    """Thompson's construction: each piece of the pattern goes from an entry state to an exit
    state it returns; epsilon moves join them, and `finish` removes them."""

    def __init__(self, pattern: str, limit: int) -> None:
        self.pattern = pattern
        self.limit = limit
        self.edges: list[list[tuple[CharSet, int]]] = []
        self.eps: list[list[int]] = []

    def refuse(self, what: str) -> PatternError:
        return PatternError(f"pattern {self.pattern!r}: {what} is not supported")

    def state(self) -> int:
        if len(self.edges) >= self.limit:
            raise NfaTooLarge(f"pattern {self.pattern!r} unrolls to too many states")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def chars(self, chars: CharSet, entry: int) -> int:
        exit_ = self.state()
        # Surrogates never stand alone in text (UTF-8 cannot encode them): no edge for them.
        chars = minus(chars, [(0xD800, 0xDFFF)])
        if chars:
            self.edges[entry].append((chars, exit_))
        return exit_

    def sequence(
        self, items: list[Any], entry: int, at_start: bool, at_end: bool, dotall: bool
    ) -> int:
        at = _sre_c.AT
        for i, (op, arg) in enumerate(items):
            first = at_start and all(o is at for o, _ in items[:i])
            last = at_end and all(o is at for o, _ in items[i + 1 :])
            entry = self.item(op, arg, entry, first, last, dotall)
        return entry

    def item(self, op: Any, arg: Any, entry: int, first: bool, last: bool, dotall: bool) -> int:
        c = _sre_c
        if op is c.LITERAL:
            return self.chars([(arg, arg)], entry)
        if op is c.NOT_LITERAL:
            return self.chars(minus(ALL, [(arg, arg)]), entry)
        if op is c.ANY:
            return self.chars(ALL if dotall else minus(ALL, [(0x0A, 0x0A)]), entry)
        if op is c.IN:
            return self.chars(self.char_class(arg), entry)
        if op is c.CATEGORY:
            return self.chars(_category(arg, inside=True), entry)
        if op is c.AT:
            # Anchors at the pattern's ends hold for any full match; elsewhere they constrain
            # their surroundings, which a grammar rule does not see.
            if arg in (c.AT_BEGINNING, c.AT_BEGINNING_STRING) and first:
                return entry
            if arg in (c.AT_END, c.AT_END_STRING) and last:
                return entry
            raise self.refuse(f"the anchor {arg} inside the pattern")
        if op is c.BRANCH:
            exit_ = self.state()
            for alternative in arg[1]:
                start = self.state()
                self.eps[entry].append(start)
                end = self.sequence(list(alternative), start, first, last, dotall)
                self.eps[end].append(exit_)
            return exit_
        if op is c.SUBPATTERN:
            _group, add_flags, _del_flags, sub = arg
            if add_flags & (re.IGNORECASE | re.LOCALE):
                raise self.refuse("a case-insensitive group")
            inner = dotall or bool(add_flags & re.DOTALL)
            return self.sequence(list(sub), entry, first, last, inner)
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):  # a lazy repeat has the same language
            low, high, sub = arg
            high = None if high >= c.MAXREPEAT else high

            def body(start: int) -> int:
                return self.sequence(list(sub), start, False, False, dotall)

            return self.repeat(body, low, high, entry)
        names = {
            "GROUPREF": "a backreference",
            "GROUPREF_EXISTS": "a conditional group",
            "ASSERT": "a lookahead or lookbehind",
            "ASSERT_NOT": "a negative lookahead or lookbehind",
            "POSSESSIVE_REPEAT": "a possessive quantifier",
            "ATOMIC_GROUP": "an atomic group",
        }
        raise self.refuse(names.get(str(op), str(op)))

    def repeat(self, body: Callable[[int], int], low: int, high: int | None, entry: int) -> int:
        for _ in range(low):
            entry = body(entry)
        if high is None:
            loop = self.state()
            self.eps[entry].append(loop)
            self.eps[body(loop)].append(loop)
            return loop
        exit_ = self.state()
        self.eps[entry].append(exit_)
        for _ in range(high - low):
            entry = body(entry)
            self.eps[entry].append(exit_)
        return exit_

    def char_class(self, items: list[Any]) -> CharSet:
        negated = bool(items) and items[0][0] is _sre_c.NEGATE
        members: CharSet = []
        for op, arg in items[1:] if negated else items:
            if op is _sre_c.LITERAL:
                members.append((arg, arg))
            elif op is _sre_c.RANGE:
                members.append((arg[0], arg[1]))
            elif op is _sre_c.CATEGORY:
                # Negated, the class needs each category from outside (a superset), so that
                # its complement stays inside the true one.
                members.extend(_category(arg, inside=not negated))
            else:
                raise self.refuse(f"{op} in a character class")
        members = normalize(members)
        return minus(ALL, members) if negated else members

    def finish(self, start: int, end: int, max_states: int) -> Nfa:
        """Remove the epsilon moves, keep the states on some path from start to accept."""
        n = len(self.edges)
        closures = [self.closure(s) for s in range(n)]
        moves: list[list[tuple[CharSet, int]]] = [
            [edge for t in closures[s] for edge in self.edges[t]] for s in range(n)
        ]
        accepting = {s for s in range(n) if end in closures[s]}
        order = _reachable(start, moves)  # breadth first: a stable numbering
        alive = _reaching(accepting, moves)
        kept = [s for s in order if s in alive]
        if start not in alive:
            raise PatternError(f"pattern {self.pattern!r} matches no string text can hold")
        if len(kept) > max_states:
            raise NfaTooLarge(
                f"pattern {self.pattern!r} unrolls to {len(kept)} grammar states (at most "
                f"{max_states}); use * or + for long runs"
            )
        number = {s: i for i, s in enumerate(kept)}
        edges: list[dict[int, CharSet]] = []
        for s in kept:
            targets: dict[int, CharSet] = {}
            for chars, t in moves[s]:
                if t in number:
                    targets[number[t]] = normalize(targets.get(number[t], []) + chars)
            edges.append(targets)
        return Nfa(edges, {number[s] for s in kept if s in accepting})

    def closure(self, state: int) -> list[int]:
        seen = {state}
        stack = [state]
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return sorted(seen)


def _reachable(start: int, moves: list[list[tuple[CharSet, int]]]) -> list[int]:
    order = [start]
    seen = {start}
    for s in order:
        for _, t in moves[s]:
            if t not in seen:
                seen.add(t)
                order.append(t)
    return order


def _reaching(targets: set[int], moves: list[list[tuple[CharSet, int]]]) -> set[int]:
    back: list[list[int]] = [[] for _ in moves]
    for s, edges in enumerate(moves):
        for _, t in edges:
            back[t].append(s)
    seen = set(targets)
    stack = list(targets)
    while stack:
        for s in back[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


@functools.cache
def _ascii_members(category: Any) -> tuple[tuple[int, int], ...]:
    regex = {
        "CATEGORY_DIGIT": r"\d",
        "CATEGORY_NOT_DIGIT": r"\D",
        "CATEGORY_SPACE": r"\s",
        "CATEGORY_NOT_SPACE": r"\S",
        "CATEGORY_WORD": r"\w",
        "CATEGORY_NOT_WORD": r"\W",
    }.get(str(category))
    if regex is None:
        raise PatternError(f"the pattern category {category} is not supported")
    return tuple(normalize([(c, c) for c in range(128) if re.fullmatch(regex, chr(c))]))


def _category(category: Any, *, inside: bool) -> CharSet:
    """A category's ASCII members (a subset of it), or those and every non-ASCII character
    (a superset of it)."""
    members = list(_ascii_members(category))
    return members if inside else normalize([*members, (0x80, MAX_CODE_POINT)])


# ---- character sets ---------------------------------------------------------------------------


def normalize(ranges: CharSet) -> CharSet:
    merged: CharSet = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def minus(a: CharSet, b: CharSet) -> CharSet:
    out: CharSet = []
    for low, high in a:
        for b_low, b_high in b:
            if b_high < low or b_low > high:
                continue
            if b_low > low:
                out.append((low, b_low - 1))
            low = b_high + 1
            if low > high:
                break
        if low <= high:
            out.append((low, high))
    return out


def intersect(a: CharSet, b: CharSet) -> CharSet:
    return minus(a, minus(ALL, b))
