"""The ctypes bindings (kernels/cpu_native.py) match the C declarations (csrc/ae_kernels.h).

ctypes trusts what it is told: a binding that lists an int64 where C takes an int, or leaves
out an argument, reads garbage or crashes, and nothing checks it at build time. So the header
is parsed here (its declarations are simple: one line per parameter list, no function pointers)
and every bound function's argument and return types are compared with it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import cpu_native

CSRC = Path(cpu_native.__file__).parent / "csrc"
HEADER = CSRC / "ae_kernels.h"
# what the build can do (bound as bools, or bitmasks of quant_legacy.c's paths and formats) and
# how it lays out dense panels (bound as a tuple)
PROBES = (
    "ae_linear_bf16_fast", "ae_linear_dense_simd", "ae_dense_panel_order", "ae_quant_paths",
    "ae_quant_formats",
)  # fmt: skip

# C parameter and return types as ctypes sees them: every pointer is a void pointer.
C_TYPES: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_DECLARATION = re.compile(r"(?P<ret>[\w ]+?)\s*\b(?P<name>ae_\w+)\s*\((?P<params>[^)]*)\)\s*;")

Signature = tuple[type | None, tuple[type | None, ...]]


def _strip_comments(c_source: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", c_source, flags=re.DOTALL)


def _header_text() -> str:
    return re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", _strip_comments(HEADER.read_text()))


def _c_type(decl: str, named: bool = True) -> type | None:
    """The ctypes type of a parameter's C declaration ("const void *x"), or of a return type
    (`named=False`)."""
    if "*" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.split() if w not in ("const", "restrict", "extern")]
    if named:
        words = words[:-1]
    assert len(words) == 1 and words[0] in C_TYPES, f"add the type of {decl!r} to C_TYPES"
    return C_TYPES[words[0]]


def header_signatures() -> dict[str, Signature]:
    """Every ae_* function ae_kernels.h declares: name -> (return type, argument types)."""
    found: dict[str, Signature] = {}
    for m in _DECLARATION.finditer(_header_text()):
        params = " ".join(m["params"].split())
        args = () if params == "void" else tuple(_c_type(p) for p in params.split(","))
        found[m["name"]] = (_c_type(m["ret"], named=False), args)
    return found


def _show(sig: Signature) -> str:
    names = {None: "void", ctypes.c_void_p: "ptr", ctypes.c_int64: "int64", ctypes.c_int: "int",
             ctypes.c_int32: "int32", ctypes.c_float: "float"}  # fmt: skip
    ret, args = sig
    return f"{names.get(ret, ret)} ({', '.join(str(names.get(a, a)) for a in args)})"


def test_the_header_parses() -> None:
    sigs = header_signatures()
    assert sigs["ae_linear_bf16_fast"] == (ctypes.c_int, ())
    assert sigs["ae_rms_norm"][0] is None and len(sigs["ae_rms_norm"][1]) == 10
    assert len(sigs) >= 12


def test_every_binding_matches_its_declaration() -> None:
    declared = header_signatures()
    mismatches = []
    for name, (restype, argtypes) in cpu_native.SIGNATURES.items():
        if name not in declared:
            mismatches.append(f"{name}: bound in cpu_native.py, not declared in ae_kernels.h")
            continue
        bound: Signature = (restype, tuple(argtypes))
        if bound != declared[name]:
            mismatches.append(
                f"{name}:\n  ae_kernels.h:  {_show(declared[name])}\n"
                f"  cpu_native.py: {_show(bound)}"
            )
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.skipif(cpu_native.load_native() is None, reason=cpu_native.unavailable_reason())
def test_the_loaded_functions_carry_those_signatures() -> None:
    # What the kernels call: the loaded library's function objects, by their C names.
    lib = cpu_native.require_native()
    declared = header_signatures()
    functions = [
        getattr(lib, f.name)
        for f in dataclasses.fields(lib)
        if isinstance(getattr(lib, f.name), ctypes._CFuncPtr)  # type: ignore[attr-defined]
    ]
    # the build probes (PROBES) are called once, at bind, and kept as their results
    assert len(functions) == len(cpu_native.SIGNATURES) - len(PROBES)
    for fn in functions:
        bound: Signature = (fn.restype, tuple(fn.argtypes))
        assert bound == declared[fn.__name__], (
            f"{fn.__name__}: ae_kernels.h {_show(declared[fn.__name__])}, bound {_show(bound)}"
        )


def test_every_declared_function_has_a_caller() -> None:
    # An exported function is called from Python (bound in cpu_native.py and called by a
    # kernel module) or from another .c file; anything else is dead code.
    kernels = Path(cpu_native.__file__).parent
    python = "\n".join(p.read_text() for p in kernels.glob("*.py") if p.name != "cpu_native.py")
    c_files = {p: _strip_comments(p.read_text()) for p in CSRC.glob("*.c")}
    dead = []
    for name in header_signatures():
        if name in cpu_native.SIGNATURES:
            field = name.removeprefix("ae_")
            if name not in PROBES and f".{field}(" not in python:
                dead.append(f"{name}: bound, but no kernels/*.py module calls .{field}(")
            continue
        # mentioned in a file other than the one that defines it (at the start of a line)
        mentioned = {p for p, text in c_files.items() if re.search(rf"\b{name}\(", text)}
        defined = {p for p, text in c_files.items() if re.search(rf"^\w.*\b{name}\(", text, re.M)}
        if not mentioned - defined:
            dead.append(f"{name}: neither bound in cpu_native.py nor called from another .c file")
    assert not dead, "\n".join(dead)


def test_the_dtype_codes_are_the_headers() -> None:
    enum = re.search(r"enum ae_dtype \{([^}]*)\}", _header_text())
    assert enum is not None
    codes = {k.strip(): int(v) for k, v in (e.split("=") for e in enum[1].split(","))}
    names = {"AE_F32": torch.float32, "AE_BF16": torch.bfloat16, "AE_F16": torch.float16}
    assert {names[k]: v for k, v in codes.items()} == cpu_native.DTYPE_CODES
