r"""EBNF for JSON strings, written here rather than by xgrammar: every character written as
JSON requires (raw where JSON allows it, escaped where it must be), and counted as Python
counts it.

A string's language is described over *decoded* characters — any character (for a length
bound), a regular expression (`pattern`), a `format` — as an NFA (regex_nfa.py), and each
decoded character becomes the JSON text that encodes it: the character itself when JSON
allows it raw, an escape when it is '"', '\' or a control character (U+0000-U+001F).
Surrogates (U+D800-U+DFFF) are never written raw (UTF-8 cannot encode them, though a
byte-level vocabulary can spell their three-byte form), and `\u` escapes of surrogates
come only as a high-low pair, which decodes to one character: so a string's length in the
grammar is its `len()` once parsed.

The shape is chosen for xgrammar's speed: one rule per NFA state, each alternative a
character then the next state's rule, the closing quote inside the rules. xgrammar 0.2.8
precomputes those rules' token masks (a few milliseconds per rule at compile, microseconds
per step); a bounded repetition of anything but a bare character class (`(c | e){0,40}`)
instead costs it ~20 ms per step on a 49k vocabulary. Hence the cap on states.

Why not xgrammar's own strings: see its loose spots in json_schema_grammar.py.
"""

from __future__ import annotations

from asyncengine.sched.regex_nfa import (
    MAX_CODE_POINT,
    CharSet,
    Nfa,
    PatternError,
    intersect,
    minus,
    normalize,
    parse,
    pattern_nfa,
)

# What JSON lets a string hold raw (not '"', '\\', U+0000-U+001F), less the surrogates.
_RAW_OK: CharSet = [(0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODE_POINT)]
# What must be escaped: the control characters, '"' and '\\'.
_ESCAPED: CharSet = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_NOT_SURROGATE: CharSet = [(0, 0xD7FF), (0xE000, MAX_CODE_POINT)]
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_HEX = "[0-9A-Fa-f]"
# Every escape, for a set holding every character: \uXXXX of any non-surrogate, or a
# surrogate pair (one character).
_ANY_ESCAPE = (
    f'"\\\\" (["\\\\/bfnrt] | "u" ([0-9A-Ca-cEFef] {_HEX} {_HEX} {_HEX} | [Dd] [0-7] {_HEX} {_HEX}'
    f' | [Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX}))'
)
# NFA states (grammar rules) per string: xgrammar precomputes each rule's token masks at
# compile time (~10 ms for a 50k vocabulary), so this bounds a schema's compile.
MAX_STATES = 256


class UnsupportedSchemaError(ValueError):
    """A JSON schema (or a pattern in it) uses something the grammar cannot enforce; the
    message names it."""


def string_rules(prefix: str) -> str:
    """Shared rules: `<prefix>escape`, what may follow a backslash in any JSON string."""
    return f"{prefix}escape ::= " + _ANY_ESCAPE.removeprefix('"\\\\" ')


def length_string(name: str, min_length: int, max_length: int | None) -> str:
    """Rules for a JSON string of `min_length` to `max_length` (None: any number of)
    characters, entered by rule `name`."""
    top = max_length if max_length is not None else min_length
    if top + 1 > MAX_STATES:
        # Too many states: xgrammar's own form (a repeated class; no escapes), strict.
        count = f"{{{min_length},{'' if max_length is None else max_length}}}"
        return f'{name} ::= "\\"" {_class_text(_RAW_OK)}{count} "\\""\n'
    edges: list[dict[int, CharSet]] = [{i + 1: _NOT_SURROGATE} for i in range(top)]
    edges.append({top: _NOT_SURROGATE} if max_length is None else {})
    accepting = set(range(min_length, top + 1))
    return _nfa_rules(name, Nfa(edges, accepting))


def pattern_string(name: str, pattern: str, min_length: int, max_length: int | None) -> str:
    """Rules for a JSON string whose value fully matches `pattern` (Python `re` syntax),
    within the length bounds; UnsupportedSchemaError for what a grammar cannot express, and
    for length bounds the pattern does not imply (a grammar cannot intersect them).

    A full match also satisfies JSON Schema's unanchored `pattern` (`re.search`): the grammar
    is stricter than the schema, never looser."""
    try:
        _, low, high = parse(pattern)
        if low < min_length or (max_length is not None and (high is None or high > max_length)):
            span = f"{low}..{'' if high is None else high}"
            raise UnsupportedSchemaError(
                f"pattern {pattern!r} beside minLength/maxLength: the pattern's lengths "
                f"({span}) must lie within them; write the bounds into the pattern instead"
            )
        return _nfa_rules(name, pattern_nfa(pattern, MAX_STATES))
    except PatternError as exc:
        raise UnsupportedSchemaError(str(exc)) from None


# ---- formats ------------------------------------------------------------------------------

# `format`s the grammar enforces, as patterns whose every match is valid for the format (and
# passes `jsonschema`'s format checker): subsets where the full syntax is large (no leap
# days or leap seconds, IPv6 as eight groups, http(s) URIs only, dot-atom emails), and
# bounded, so that a length bound beside them can be checked and their NFAs stay small.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,18}[A-Za-z0-9])?"
_HOSTNAME = rf"(?:{_LABEL}\.){{0,3}}[A-Za-z](?:[A-Za-z0-9-]{{0,18}}[A-Za-z0-9])?"
_DATE = (
    r"[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_HOUR_MINUTE = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = rf"{_HOUR_MINUTE}:[0-5][0-9](?:\.[0-9]{{1,6}})?(?:Z|[+-]{_HOUR_MINUTE})"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,16}"
_URI_CHARS = r"[A-Za-z0-9._~!$&'()*+,;=:@-]"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "email": rf"{_ATOM}(?:\.{_ATOM}){{0,2}}@{_HOSTNAME}",
    "hostname": _HOSTNAME,
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": r"[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){7}",
    "uri": rf"https?://{_HOSTNAME}(?::[1-9][0-9]{{0,3}})?(?:/{_URI_CHARS}{{0,16}}){{0,4}}",
    "uuid": r"[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}",
}
# The other formats JSON Schema (2020-12) defines: refused, not ignored, so that a schema
# asking for one never gets an arbitrary string. Formats outside the specification are
# annotations (no validator checks them) and are ignored.
REFUSED_FORMATS = frozenset(
    {
        "duration", "idn-email", "idn-hostname", "uri-reference", "iri", "iri-reference",
        "uri-template", "json-pointer", "relative-json-pointer", "regex",
    }
)  # fmt: skip


def format_string(name: str, form: str, min_length: int, max_length: int | None) -> str:
    """Rules for a JSON string in format `form` (one of FORMATS), within the length bounds,
    entered by rule `name`."""
    try:
        return pattern_string(name, FORMATS[form], min_length, max_length)
    except UnsupportedSchemaError:
        raise UnsupportedSchemaError(
            f"format {form!r} beside minLength/maxLength is supported only when every "
            f"{form} string is within the bounds"
        ) from None


# ---- NFA → EBNF ---------------------------------------------------------------------------


def _nfa_rules(name: str, nfa: Nfa) -> str:
    """One rule per state: a character's JSON text then the next state, or the closing
    quote where the state accepts."""
    lines = [f'{name} ::= "\\"" {name}_0']
    for state, targets in enumerate(nfa.edges):
        alternatives = [
            f"{term} {name}_{target}"
            for target, chars in targets.items()
            for term in _char_terms(chars)
        ]
        if state in nfa.accepting:
            alternatives.append('"\\""')
        lines.append(f"{name}_{state} ::= " + " | ".join(alternatives))
    return "\n".join(lines) + "\n"


def _char_terms(chars: CharSet) -> list[str]:
    """One decoded character from `chars`, as alternatives of JSON text: the raw ones as a
    class, the others (control characters, '"', '\\') as escapes."""
    terms = []
    raw = intersect(chars, _RAW_OK)
    if raw:
        terms.append(_class_text(raw))
    if not minus(_NOT_SURROGATE, chars):
        terms.append(_ANY_ESCAPE)  # every character: every escape
        return terms
    escaped = [c for low, high in intersect(chars, _ESCAPED) for c in range(low, high + 1)]
    options = []
    short = [_SHORT_ESCAPES[c] for c in escaped if c in _SHORT_ESCAPES]
    if short:
        options.append(_ebnf_literal("".join(short)) if len(short) == 1 else _set_text(short))
    for high_digit in (0, 1):
        lows = [c & 0xF for c in escaped if c >> 4 == high_digit]
        if lows:
            options.append(f'"u00{high_digit}" {_hex_digits(lows)}')
    if options:
        terms.append('"\\\\" ' + (options[0] if len(options) == 1 else f"({' | '.join(options)})"))
    return terms


def _set_text(chars: list[str]) -> str:
    return _class_text(normalize([(ord(c), ord(c)) for c in chars]))


def _hex_digits(values: list[int]) -> str:
    """A class of the hex digits of `values` (0-15), in both cases."""
    return _set_text([d for v in values for d in {f"{v:x}", f"{v:X}"}])


def _escape_code_point(c: int) -> str:
    # Never \x: xgrammar reads as many hex digits as follow it ("\x5cb" is U+05CB).
    if c < 0x10000:
        return f"\\u{c:04x}"
    return f"\\U{c:08x}"


def _class_text(chars: CharSet) -> str:
    def one(c: int) -> str:
        return chr(c) if chr(c).isascii() and chr(c).isalnum() else _escape_code_point(c)

    items = [one(lo) if lo == hi else f"{one(lo)}-{one(hi)}" for lo, hi in chars]
    return "[" + "".join(items) + "]"


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isascii() and (ch.isalnum() or ch in " !#$%&'()*+,-./:;<=>?@[]^_`{|}~"):
            out.append(ch)
        else:
            out.append(_escape_code_point(ord(ch)))
    return '"' + "".join(out) + '"'
