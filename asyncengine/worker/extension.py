"""Worker extensions: the user's methods on every worker, for `AsyncLLM.collective_rpc`.

`worker_extension_cls="package.module:Class"` (EngineConfig, `--worker-extension-cls`) names a
class whose public methods are mixed into the Worker class, as vLLM's `worker_extension_cls`:
in them `self` is the worker (`self.rank`, `self.device`, `self.model_runner`). Each process
that needs the class imports it by that path (worker processes are spawned fresh, so nothing
done at run time in the client reaches them). Only the class's own public methods can be
called through `collective_rpc`; the engine's (load_model, execute_model, sleep, ...) cannot.

This module imports no torch: the engine core checks method names with it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

# Worker methods that `collective_rpc` may call besides an extension's (documented in
# docs/async.md): harmless, read-only ones.
ALLOWED_WORKER_METHODS: frozenset[str] = frozenset({"pid"})


class UnencodableResultError(TypeError):
    """An extension method returned what msgspec cannot encode (it cannot cross a socket)."""


@functools.cache
def load_extension(path: str) -> type[Any]:
    """The class `path` names ("package.module:Class" or "package.module.Class").

    ImportError / AttributeError with the path when it can't be imported; TypeError when it
    is no class."""
    module_name, sep, class_name = path.partition(":")
    if not sep:
        module_name, _, class_name = path.rpartition(".")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise AttributeError(
            f"worker_extension_cls={path!r}: module {module_name!r} has no {class_name!r}"
        ) from None
    if not isinstance(cls, type):
        raise TypeError(f"worker_extension_cls={path!r} is not a class")
    return cls


def extension_methods(cls: type[Any]) -> frozenset[str]:
    """The public methods `cls` defines (itself or its bases other than object)."""
    names = set()
    for klass in cls.__mro__[:-1]:
        for name, value in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(value):
                names.add(name)
    return frozenset(names)


def callable_methods(path: str | None) -> frozenset[str]:
    """What `collective_rpc` may call with this extension (None: none but the allowlist)."""
    if path is None:
        return ALLOWED_WORKER_METHODS
    return extension_methods(load_extension(path)) | ALLOWED_WORKER_METHODS


def check_method(path: str | None, method: str) -> None:
    """ValueError naming `method` and the callable ones unless `collective_rpc` may call it."""
    allowed = callable_methods(path)
    if method in allowed:
        return
    if path is None:
        hint = "no worker_extension_cls is configured"
    else:
        hint = f"worker_extension_cls={path!r}"
    raise ValueError(
        f"collective_rpc: unknown method {method!r} ({hint}); callable methods: "
        f"{', '.join(sorted(allowed))}"
    )


def with_extension(base: type[Any], path: str | None) -> type[Any]:
    """`base` (the Worker class) with the extension's methods mixed in, or `base` itself.

    ValueError when the extension defines a name the worker already has: the engine's own
    methods are never replaced."""
    if path is None:
        return base
    ext = load_extension(path)
    clash = sorted(
        name
        for klass in ext.__mro__[:-1]
        for name in vars(klass)
        if not name.startswith("__") and hasattr(base, name)
    )
    if clash:
        raise ValueError(
            f"worker_extension_cls={path!r} defines {', '.join(clash)}, which the worker "
            "already has: rename them"
        )
    return type(f"{base.__name__}With{ext.__name__}", (base, ext), {})
