r"""JSON schema → the EBNF grammar the engine compiles: xgrammar's conversion, made strict
where it is loose, refusing the schema features it would not enforce.

The guarantee: every output the grammar accepts parses with a strict `json.loads` and
validates against the schema (draft 2020-12, as `jsonschema` checks it, with its format
checker). A feature the grammar cannot enforce is refused with `UnsupportedSchemaError`,
naming it and where it is, rather than silently ignored.

How: the schema is walked first (`_Rewriter`): what cannot be enforced is refused; every
string schema with a length bound, a `pattern` or a `format` is replaced by a unique
placeholder constant, which xgrammar writes as a literal, and which is then replaced in its
EBNF by a rule of ours (json_string_grammar.py); xgrammar's own string rules (plain strings,
object keys, any-JSON values) are tightened in its EBNF text.

xgrammar 0.2.8 is loose here (each is checked by tests/sched/test_json_schema_grammar.py's
`test_xgrammar_is_still_loose`, which fails once a release fixes it: then the matching
workaround can go):

1. minLength/maxLength strings are `[^"\\\r\n]{m,n}`: raw control characters (invalid
   JSON), no escapes, and surrogates (three bytes, which decode to three U+FFFD) pass.
2. `pattern` and `format` strings: a '"', '\\' or control character in the pattern is
   written raw (invalid JSON), `[\s\S]` admits overlong UTF-8, and a length bound beside
   them is ignored. Formats: `email` admits invalid escapes, `json-pointer` raw control
   characters, `date` a 31st of June, `ipv4` leading zeros (invalid for `jsonschema`).
3. Plain strings admit surrogates spelled in UTF-8 bytes and lone `\uD800` escapes.
4. Ignored without a word (so refused here): `enum`/`const` beside other keywords (the
   values are emitted unfiltered), siblings of `anyOf`/`oneOf`/`allOf`/`$ref`, `required`
   names missing from `properties`, keywords without a `type`, `uniqueItems`, `contains`,
   `multipleOf` on numbers, `allOf` of several schemas, overlapping `oneOf` (taken as
   `anyOf`), `not`, `if`/`then`/`else`, the dependent* keywords, `propertyNames` (also loose
   as in 1) and `patternProperties` (loose as in 2).
5. Its printed EBNF, which we compile, writes U+0080-U+00FF as "\xHH" but parses "\x" with
   every hex digit that follows (`_fixed_width_escapes`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

from asyncengine.sched.json_string_grammar import (
    FORMATS,
    REFUSED_FORMATS,
    UnsupportedSchemaError,
    format_string,
    length_string,
    pattern_string,
    string_rules,
)

__all__ = ["UnsupportedSchemaError", "json_object_ebnf", "json_schema_ebnf"]

_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
# Validation keywords by the type they apply to; a keyword of another type is ignored.
_FAMILIES = {
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"},
    "object": {
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
    },
}
_APPLICATORS = ("anyOf", "oneOf", "allOf", "$ref")
_DEFS = ("$defs", "definitions")
_REFUSED = {
    "not": "negation",
    "if": "conditionals (if/then/else)",
    "then": "conditionals (if/then/else)",
    "else": "conditionals (if/then/else)",
    "dependentRequired": "dependencies between properties",
    "dependentSchemas": "dependencies between properties",
    "dependencies": "dependencies between properties",
    "contains": "contains",
    "minContains": "contains",
    "maxContains": "contains",
    "patternProperties": "patternProperties",
    "propertyNames": "propertyNames",
    "additionalItems": "additionalItems (use prefixItems and items)",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references",
}
# Every keyword that constrains an instance; what is not here is an annotation.
_VALIDATION = (
    {"type", "enum", "const", *_APPLICATORS, *_REFUSED} | set().union(*_FAMILIES.values())
) - {"format"}  # format validates only for the formats the grammar enforces (below)

# xgrammar's plain-string rules (item 3 above), as it prints them, and their strict forms.
# (After _fixed_width_escapes.)
_LOOSE_STRING_CHAR = r"[^\0-\u001f\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\u001f\"\\\ud800-\udfff]"
_LOOSE_ESCAPE = re.compile(r"^basic_escape ::= .*$", re.MULTILINE)


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF grammar of compact JSON (`", "` and `": "` separators) valid against the
    schema; UnsupportedSchemaError names a feature it cannot enforce. xgrammar's
    RuntimeError reports a schema it cannot convert."""
    import xgrammar

    schema = json.loads(schema_text)
    rewriter = _Rewriter(schema, schema_text)
    prepared = rewriter.rewrite(schema, "")
    ebnf = str(
        xgrammar.Grammar.from_json_schema(
            json.dumps(prepared), any_whitespace=False, strict_mode=True
        )
    )
    return rewriter.splice(_tighten(ebnf, rewriter.prefix))


@functools.cache
def json_object_ebnf() -> str:
    """The EBNF grammar of any compact JSON object."""
    import xgrammar

    ebnf = str(
        xgrammar.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    )
    return _tighten(ebnf, "aestr_") + "\n" + string_rules("aestr_") + "\n"


def _tighten(ebnf: str, prefix: str) -> str:
    ebnf = _fixed_width_escapes(ebnf)
    # Plain strings: no surrogates raw (\r and \n were already inside \0-\x1f), and \u
    # escapes as in our strings (no lone surrogates).
    ebnf = ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
    return _LOOSE_ESCAPE.sub(f"basic_escape ::= {prefix}escape", ebnf)


def _fixed_width_escapes(ebnf: str) -> str:
    r"""xgrammar prints U+0080-U+00FF as "\xHH" but parses "\x" followed by every hex digit
    there is: a key "éa" prints as "\xe9a", which parses back as U+0E9A. "\u00HH" reads
    exactly four digits."""
    out = []
    i = 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "\\" and ebnf[i + 1 : i + 2] == "x":
            out.append("\\u00" + ebnf[i + 2 : i + 4])
            i += 4
        elif ch == "\\":
            out.append(ebnf[i : i + 2])  # another escape: its second character is not a start
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


class _Rewriter:
    """Walks a schema: refuses what the grammar cannot enforce, and swaps string schemas
    with bounds, patterns or formats for placeholders (`splice` puts our rules there)."""

    def __init__(self, root: Any, text: str) -> None:
        self.root = root
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        self.marker = f"aemark{digest}n"
        self.prefix = "aestr_"
        self.strings: list[str] = []  # each string's rules, by placeholder number

    def rewrite(self, node: Any, path: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise _refuse(path, "a schema must be an object or a boolean")
        node = dict(node)
        for key in _DEFS:
            if isinstance(node.get(key), dict):
                node[key] = {
                    name: self.rewrite(sub, f"{path}/{key}/{name}")
                    for name, sub in node[key].items()
                }
        for key, what in _REFUSED.items():
            if key in node:
                raise _refuse(path, f"{key}: {what} is not supported")
        if any(key in node for key in _APPLICATORS):
            return self.applicator(node, path)
        if "enum" in node or "const" in node:
            return self.constant(node, path)
        types = self.types(node, path)
        if types is None:
            return node  # xgrammar names the invalid type
        self.check_numbers(node, types, path)
        self.check_arrays(node, types, path)
        self.check_objects(node, types, path)
        if "string" in types and _string_keywords(node, path):
            return self.string(node, types, path)
        return self.children(node, path)

    # ---- kinds of schema ---------------------------------------------------------------

    def applicator(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        present = [key for key in _APPLICATORS if key in node]
        siblings = [k for k in _validation_keys(node) if k not in present]
        if len(present) > 1 or siblings:
            raise _refuse(
                path,
                f"{', '.join(present + siblings)} together: xgrammar enforces only "
                f"{present[0]} and ignores the rest; put them in one schema",
            )
        key = present[0]
        if key == "$ref":
            return node
        branches = node[key]
        if not isinstance(branches, list) or not branches:
            raise _refuse(path, f"{key} must be a non-empty list of schemas")
        if key == "allOf" and len(branches) > 1:
            raise _refuse(path, "allOf of several schemas is not supported; merge them")
        if key == "oneOf" and len(branches) > 1 and not self.exclusive(branches):
            raise _refuse(
                path,
                "oneOf whose branches may overlap is not supported (the grammar would take "
                "it as anyOf); use anyOf, or branches of different types or const values",
            )
        node[key] = [self.rewrite(b, f"{path}/{key}/{i}") for i, b in enumerate(branches)]
        return node

    def constant(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        siblings = [k for k in _validation_keys(node) if k not in ("enum", "const")]
        if ("enum" in node and "const" in node) or (siblings and siblings != ["type"]):
            raise _refuse(
                path,
                f"enum/const beside {', '.join(siblings or ['const'])}: only type may go "
                "with them (the grammar emits their values unchecked)",
            )
        values = node["enum"] if "enum" in node else [node["const"]]
        if not isinstance(values, list) or not values:
            raise _refuse(path, "enum must be a non-empty list")
        if "type" in node:
            types = self.types(node, path)
            if types is None:
                raise _refuse(path, f"type {node['type']!r} is not a JSON Schema type")
            values = [v for v in values if any(_is_type(v, t) for t in types)]
            if not values:
                raise _refuse(path, "no value of enum/const has the schema's type")
        kept = {k: v for k, v in node.items() if k not in _VALIDATION}
        return {**kept, "enum": values}

    def string(self, node: dict[str, Any], types: list[str], path: str) -> dict[str, Any]:
        number = len(self.strings)
        self.strings.append(self.string_grammar(f"{self.prefix}{number}", node, path))
        placeholder = {"const": f"{self.marker}{number}"}
        for key in _DEFS:
            if key in node:
                placeholder[key] = node[key]
        if types == ["string"]:
            return placeholder
        # A string among other types: the string as its own branch (anyOf).
        others = {k: v for k, v in node.items() if k not in _FAMILIES["string"] and k not in _DEFS}
        others["type"] = [t for t in types if t != "string"]
        return {"anyOf": [placeholder, self.children(others, path)]}

    def string_grammar(self, name: str, node: dict[str, Any], path: str) -> str:
        """The rules of the string schema `node`, entered by rule `name`."""
        low = node.get("minLength", 0)
        high = node.get("maxLength")
        for key, value in (("minLength", low), ("maxLength", high)):
            if value is not None and not (_is_type(value, "integer") and value >= 0):
                raise _refuse(path, f"{key} must be a non-negative integer")
        low, high = int(low), None if high is None else int(high)
        if high is not None and high < low:
            raise _refuse(path, "maxLength is below minLength: no string fits")
        form = _format(node, path)
        pattern = node.get("pattern")
        if pattern is not None and (form is not None or not isinstance(pattern, str)):
            raise _refuse(path, "pattern must be a string, and not beside a format")
        try:
            if pattern is not None:
                return pattern_string(name, pattern, low, high)
            if form is not None:
                return format_string(name, form, low, high)
        except UnsupportedSchemaError as exc:
            raise _refuse(path, str(exc)) from None
        return length_string(name, low, high)

    def children(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        if isinstance(node.get("properties"), dict):
            node["properties"] = {
                name: self.rewrite(sub, f"{path}/properties/{name}")
                for name, sub in node["properties"].items()
            }
        for key in ("additionalProperties", "items"):
            if isinstance(node.get(key), dict):
                node[key] = self.rewrite(node[key], f"{path}/{key}")
        if isinstance(node.get("prefixItems"), list):
            node["prefixItems"] = [
                self.rewrite(sub, f"{path}/prefixItems/{i}")
                for i, sub in enumerate(node["prefixItems"])
            ]
        return node

    # ---- checks --------------------------------------------------------------------------

    def types(self, node: dict[str, Any], path: str) -> list[str] | None:
        """The schema's types (None if `type` is invalid); a schema without `type` gets the
        one its keywords imply."""
        given = node.get("type")
        if given is None:
            families = [f for f, keys in _FAMILIES.items() if any(k in node for k in keys)]
            if "string" in families and not _string_keywords(node, path):
                families.remove("string")  # only an annotation-format
            if len(families) > 1:
                raise _refuse(path, f"keywords of types {', '.join(families)} without a type")
            if families:
                # Only that type: a narrower language than the schema's, never a wider one.
                node["type"] = families[0]
            return families or list(_TYPES)
        types = [given] if isinstance(given, str) else given
        if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
            return None
        return list(types)

    def check_numbers(self, node: dict[str, Any], types: list[str], path: str) -> None:
        for key in _FAMILIES["number"]:
            if key in node and not _is_type(node[key], "number"):
                raise _refuse(path, f"{key} must be a number")
        if "multipleOf" in node and (
            "number" in types or not _is_type(node["multipleOf"], "integer")
        ):
            raise _refuse(
                path, "multipleOf is supported only for type integer, with an integer divisor"
            )

    def check_arrays(self, node: dict[str, Any], types: list[str], path: str) -> None:
        if "items" in node and not isinstance(node["items"], (dict, bool)):
            raise _refuse(path, "items must be a schema (for tuples, use prefixItems)")
        if node.get("uniqueItems") and node.get("maxItems", 2) > 1:
            raise _refuse(path, "uniqueItems is not supported (the grammar cannot enforce it)")
        if node.get("unevaluatedItems", False) is not False:
            raise _refuse(path, "unevaluatedItems other than false is not supported")

    def check_objects(self, node: dict[str, Any], types: list[str], path: str) -> None:
        properties = node.get("properties", {})
        missing = [n for n in node.get("required", []) if n not in properties]
        if missing:
            raise _refuse(
                path, f"required names {', '.join(map(repr, missing))}, not in properties"
            )
        if node.get("unevaluatedProperties", False) is not False:
            raise _refuse(path, "unevaluatedProperties other than false is not supported")
        # Extra keys may repeat (the grammar does not see them all at once), and a parser
        # keeps one of each: a count of them is not enforced.
        extra = node.get("additionalProperties", False) is not False
        if extra and node.get("minProperties", 0) > len(node.get("required", [])):
            raise _refuse(path, "minProperties above the required count, with additionalProperties")

    def exclusive(self, branches: list[Any]) -> bool:
        """Whether no value can satisfy two of `branches` (a sufficient check)."""
        resolved = [self.resolve(b) for b in branches]
        kinds = [_kinds(b) for b in resolved]
        if all(k is not None for k in kinds) and _disjoint(kinds):
            return True
        values = [_values(b) for b in resolved]
        if all(v is not None for v in values) and _disjoint(values):
            return True
        # Objects told apart by a required property with different constant values.
        if not all(isinstance(b, dict) for b in resolved):
            return False
        shared = set.intersection(*(set(b.get("required", [])) for b in resolved))
        for name in shared:
            tags = [_values(self.resolve(b.get("properties", {}).get(name))) for b in resolved]
            if all(t is not None for t in tags) and _disjoint(tags):
                return True
        return False

    def resolve(self, node: Any) -> Any:
        """Follow local `$ref`s ("#/a/b")."""
        for _ in range(32):
            if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
                return node
            ref = node["$ref"]
            if not ref.startswith("#"):
                return node
            node = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(node, dict) or part not in node:
                    return None
                node = node[part]
        return node

    # ---- EBNF ----------------------------------------------------------------------------

    def splice(self, ebnf: str) -> str:
        """Put our string rules where xgrammar wrote the placeholders."""
        rules = [string_rules(self.prefix)]
        for i, text in enumerate(self.strings):
            ebnf = ebnf.replace(f'\\"{self.marker}{i}\\"', f'" {self.prefix}{i} "')
            rules.append(text)
        if self.marker in ebnf:  # xgrammar printed a placeholder unlike a literal
            raise RuntimeError("structured outputs: a string placeholder was left in the grammar")
        return ebnf + "\n" + "\n".join(rules) + "\n"


def _refuse(path: str, what: str) -> UnsupportedSchemaError:
    return UnsupportedSchemaError(f"unsupported JSON schema at {path or '/'}: {what}")


def _string_keywords(node: dict[str, Any], path: str) -> bool:
    return any(k in node for k in ("minLength", "maxLength", "pattern")) or (
        _format(node, path) is not None
    )


def _format(node: dict[str, Any], path: str) -> str | None:
    """The schema's format if the grammar must enforce it; UnsupportedSchemaError for a
    format JSON Schema defines that the grammar does not."""
    name = node.get("format")
    if name in FORMATS:
        return str(name)
    if name in REFUSED_FORMATS:
        supported = ", ".join(sorted(FORMATS))
        raise _refuse(path, f"format {name!r} is not supported (supported: {supported})")
    return None


def _validation_keys(node: dict[str, Any]) -> list[str]:
    """The keywords of `node` that constrain an instance (`format` when it is a known one)."""
    known_format = node.get("format") in FORMATS or node.get("format") in REFUSED_FORMATS
    return sorted(k for k in node if k in _VALIDATION or (k == "format" and known_format))


def _is_type(value: Any, kind: str) -> bool:
    """`jsonschema`'s type check (1.0 is an integer; a bool is not a number)."""
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return kind == "number" or float(value).is_integer()


def _kinds(node: Any) -> set[str] | None:
    """The JSON kinds a schema admits (integer counted as number), or None if unknown."""
    if not isinstance(node, dict):
        return None
    given = node.get("type")
    if isinstance(given, str):
        given = [given]
    if isinstance(given, list):
        return {"number" if t == "integer" else str(t) for t in given}
    values = _values(node)
    if values is None:
        return None
    return {next(k for k in _TYPES if _is_type(json.loads(v), k)) for v in values}


def _values(node: Any) -> set[str] | None:
    """The values a const/enum schema admits, as canonical JSON text; None if not one."""
    if not isinstance(node, dict):
        return None
    values = node["enum"] if "enum" in node else [node["const"]] if "const" in node else None
    if not isinstance(values, list):
        return None
    return {json.dumps(_canonical(v), sort_keys=True) for v in values}


def _canonical(value: Any) -> Any:
    # JSON Schema compares numbers by value: 1 and 1.0 are one value.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def _disjoint(sets: list[Any]) -> bool:
    seen: set[str] = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True
