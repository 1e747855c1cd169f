"""The package's imports point downstream only, and form no cycle.

The graph is read from the source with `ast` (nothing is imported), and it counts every
import: module level, inside functions (lazy imports hide cycles from a plain `import`), and
under TYPE_CHECKING. The order is the one `docs/architecture.md` documents.
"""

from __future__ import annotations

import ast
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "asyncengine"

# Top to bottom: a module may import from its own layer and from the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("asyncengine", "asyncengine.testing"),  # the public façade; test helpers
    ("asyncengine.entrypoints", "asyncengine.integrations"),
    ("asyncengine.client",),
    ("asyncengine.core",),
    ("asyncengine.sched",),
    ("asyncengine.executor",),
    ("asyncengine.worker",),
    ("asyncengine.model",),
    ("asyncengine.kernels",),
    # Wire types, shared by the layers above: client ↔ core, scheduler → workers,
    # executor ↔ worker processes.
    ("asyncengine.ipc",),
    # The public types and the helpers every layer may use.
    (
        "asyncengine.block_hash",
        "asyncengine.child_process",
        "asyncengine.config",
        "asyncengine.default_model",
        "asyncengine.errors",
        "asyncengine.gguf",  # GGUF files read with the standard library (config reads them)
        "asyncengine.gpus",  # the visible GPUs, found without torch
        "asyncengine.heap",
        "asyncengine.lora",  # LoRARequest, LoRAConfig, PEFT folder checks (no torch)
        "asyncengine.model_files",  # config.json and generation_config.json, read with json
        "asyncengine.outputs",
        "asyncengine.paths",
        "asyncengine.process_setup",
        "asyncengine.request_limits",
        "asyncengine.sampling_params",
        "asyncengine.version",
    ),
]

# Units reached only from the named importers (besides themselves and the test helpers):
# the scheduler is the core's; the torch side (worker, model, kernels) is reached through the
# executor, so neither the client nor the core imports torch by accident.
PRIVATE_TO: dict[str, tuple[str, ...]] = {
    "asyncengine.sched": ("asyncengine.core",),
    "asyncengine.worker": ("asyncengine.executor",),
    "asyncengine.model": ("asyncengine.executor", "asyncengine.worker"),
    "asyncengine.kernels": ("asyncengine.worker", "asyncengine.model"),
}
EXEMPT_IMPORTERS = ("asyncengine", "asyncengine.testing")

# Arrows that stay one-way inside a layer: (importer, imported) pairs that never meet. The
# web-framework integrations build on the entry points' SSE framing (entrypoints/sse.py,
# sse_response.py), never the other way round.
NEVER_IMPORTS: list[tuple[str, str]] = [
    ("asyncengine.entrypoints", "asyncengine.integrations"),
]


def _source_files() -> Iterator[tuple[str, Path]]:
    """(module name, file) for every module; kernels/ is the asyncengine.kernels package
    (through the asyncengine/kernels symlink, or at the top level)."""
    seen: set[Path] = set()
    roots = [(PACKAGE, ROOT / PACKAGE), (f"{PACKAGE}.kernels", ROOT / "kernels")]
    for prefix, base in roots:
        for folder, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__" and d != "csrc"]
            for name in files:
                path = Path(folder) / name
                if not name.endswith(".py") or path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                parts = list(path.relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                yield ".".join([prefix, *parts]), path


def _imports(module: str, path: Path, modules: set[str]) -> Iterator[tuple[str, int]]:
    """The package modules that `module` imports, with the line of each import."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in modules else base), node.lineno


def _graph() -> dict[str, dict[str, int]]:
    files = dict(_source_files())
    modules = set(files)
    return {
        module: {target: line for target, line in _imports(module, path, modules)}
        for module, path in files.items()
    }


def _contains(unit: str, module: str) -> bool:
    # The façade is the package's __init__ alone, not everything under the package.
    return module == unit or (unit != PACKAGE and module.startswith(unit + "."))


def _unit(module: str, units: list[str]) -> str:
    """The longest unit (layer entry) that contains `module`."""
    return max((u for u in units if _contains(u, module)), key=len)


def test_every_module_has_a_layer() -> None:
    units = [u for layer in LAYERS for u in layer]
    missing = sorted(m for m in _graph() if not any(_contains(u, m) for u in units))
    assert not missing, (
        f"give these modules a layer in LAYERS (and docs/architecture.md): {missing}"
    )


def test_imports_point_downstream_only() -> None:
    units = [u for layer in LAYERS for u in layer]
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad: list[str] = []
    for module, targets in sorted(_graph().items()):
        src = _unit(module, units)
        for target, line in sorted(targets.items()):
            dst = _unit(target, units)
            if dst == src:
                continue
            if rank[dst] < rank[src]:
                bad.append(f"{module}:{line} imports {target}, which is upstream ({dst})")
            private = PRIVATE_TO.get(dst)
            if private and src not in (*private, *EXEMPT_IMPORTERS):
                bad.append(
                    f"{module}:{line} imports {target}: {dst} is reached only from "
                    f"{', '.join(private)}"
                )
    assert not bad, "imports against the documented order:\n" + "\n".join(bad)


def test_one_way_arrows_inside_a_layer() -> None:
    bad = [
        f"{module}:{line} imports {target}: {importer} never imports {imported}"
        for importer, imported in NEVER_IMPORTS
        for module, targets in sorted(_graph().items())
        if _contains(importer, module)
        for target, line in sorted(targets.items())
        if _contains(imported, target)
    ]
    assert not bad, "imports against the documented order:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    graph = {m: set(t) - {m} for m, t in _graph().items()}
    lines = _graph()
    # Depth-first search; a back edge closes a cycle, printed with the line of each import.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                cycles.append(
                    " -> ".join(f"{a} (line {lines[a][b]})" for a, b in itertools.pairwise(cycle))
                    + f" -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    source = (
        "from . import sibling\n"
        "def f():\n"
        "    from asyncengine.core.engine_core import EngineCore\n"
        "    import asyncengine.ipc.messages\n"
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    modules = {"asyncengine.client.sibling", "asyncengine.core.engine_core"}
    found = dict(_imports("asyncengine.client.mod", path, modules))
    assert found == {
        "asyncengine.client.sibling": 1,
        "asyncengine.core.engine_core": 3,
        "asyncengine.ipc.messages": 4,
    }
