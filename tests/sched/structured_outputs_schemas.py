"""JSON schemas of the supported subset as hypothesis strategies, and the check that every
finished JSON-constrained output must pass: a strict `json.loads`, no lone surrogate, and
`jsonschema` (draft 2020-12, formats checked).

Every schema here is bounded (strings by maxLength, a pattern or a format; arrays by
maxItems), so that a random model ends it within a test's token budget."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=5)
# Text that JSON must escape (quote, backslash, control characters) or that UTF-8 spells in
# several bytes: for enum values, const values and property names.
TRICKY_TEXT = st.text(alphabet=st.sampled_from('ab"\\\t\x01\n/é€😀'), max_size=4)

# Patterns, bounded, each probing a loose spot of xgrammar 0.2.8 (json_schema_grammar.py).
PATTERNS = [
    r"^[a-z]{1,4}$",
    r"[\s\S]{1,3}",  # any character: control characters, quotes, non-ASCII
    r"\W{1,3}",  # Python's \W: no non-ASCII letters
    r"\D\S{0,2}",
    r'a"b\\c',  # a quote and a backslash
    r"(ab|c\t){1,2}",
    r"[^a-z]{2}",
    r"\d{3}-\w{2}",
    r"(?s).{0,3}",
    r"[\x00-\x1f]{1,2}",
    r"é?€{1,2}😀",
]
# Formats whose strings are short enough for a random model's token budget; the rest
# (email, hostname, uri) are left to the grammar-level tests.
SHORT_FORMATS = ["date", "time", "date-time", "uuid", "ipv4", "ipv6"]
ALL_FORMATS = [*SHORT_FORMATS, "email", "hostname", "uri"]


def strings(formats: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra},
            st.integers(0, 2),
            st.integers(0, 6),
        ),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.sampled_from(formats).map(lambda f: {"type": "string", "format": f}),
        st.integers(0, 4).map(lambda n: {"type": ["string", "null"], "maxLength": n}),
    )


def leaves(formats: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    scalar = st.one_of(TRICKY_TEXT, st.integers(-5, 5), st.booleans(), st.none())
    return st.one_of(
        strings(formats),
        st.builds(
            lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
            st.integers(-50, 50),
            st.integers(0, 1000),
        ),
        st.integers(2, 9).map(
            lambda k: {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": k}
        ),
        st.builds(
            lambda low, span, exclusive: {
                "type": "number",
                ("exclusiveMinimum" if exclusive else "minimum"): low,
                "maximum": low + span,
            },
            st.integers(-100, 100).map(lambda n: n / 10),
            st.integers(1, 100).map(lambda n: n / 4),
            st.booleans(),
        ),
        st.sampled_from([{"type": "integer"}, {"type": "number"}]),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(scalar, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        scalar.map(lambda v: {"const": v}),
    )


def values(depth: int, formats: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    leaf = leaves(formats)
    if depth == 0:
        return leaf
    return st.one_of(
        leaf,
        st.builds(
            lambda items, low, extra: {
                "type": "array",
                "items": items,
                "minItems": low,
                "maxItems": low + extra,
            },
            leaf,
            st.integers(0, 1),
            st.integers(0, 2),
        ),
        st.lists(leaf, min_size=1, max_size=2).map(
            lambda items: {"type": "array", "prefixItems": items, "items": False}
        ),
        st.lists(leaf, min_size=2, max_size=3).map(lambda b: {"anyOf": b}),
        st.builds(
            lambda n, s: {"oneOf": [n, s, {"type": "boolean"}]},
            st.just({"type": "integer", "minimum": 0, "maximum": 9}),
            strings(formats),
        ),
        objects(depth - 1, formats),
    )


def objects(depth: int, formats: list[str], min_size: int = 1) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(props, required, strict=False) if r],
            "additionalProperties": False,
        }

    keys = st.one_of(NAMES, TRICKY_TEXT.filter(bool))
    return st.builds(
        build,
        st.dictionaries(
            keys, st.deferred(lambda: values(depth, formats)), min_size=min_size, max_size=4
        ),
        st.lists(st.booleans(), min_size=4, max_size=4),
    )


def schemas(formats: list[str] = ALL_FORMATS) -> st.SearchStrategy[dict[str, Any]]:
    """Objects of 2 to 4 properties, nested up to three deep (each example tries several
    kinds of value at once: a test affords only a few dozen examples)."""
    return objects(1, formats, min_size=2)


def check_output(text: str, schema: dict[str, Any]) -> None:
    """AssertionError / ValueError unless `text` is strict JSON, valid against `schema`."""
    value = json.loads(text)  # strict: raw control characters in strings are refused
    # A lone surrogate (a "\ud800" escape) parses, but no UTF-8 text can hold it.
    json.dumps(value, ensure_ascii=False).encode("utf-8")
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    validator.validate(value)
