"""`import asyncengine` is light: no torch, no transformers, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "triton", "numpy")


@pytest.mark.parametrize(
    "statement",
    [
        "import asyncengine",
        "from asyncengine import SamplingParams, RequestOutput, RequestOutputKind",
        "from asyncengine import EngineConfig",
        "import asyncengine.entrypoints.cli",
        "import asyncengine.default_model",
    ],
)
def test_import_loads_no_torch(statement: str) -> None:
    code = (
        f"{statement}\n"
        "import sys\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"{statement!r} imported {proc.stdout.strip()}"


def test_kernels_import_as_a_subpackage() -> None:
    # kernels/ sits at the repository root but installs as asyncengine.kernels.
    proc = subprocess.run(
        [sys.executable, "-c", "import asyncengine.kernels as k; print(k.__name__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "asyncengine.kernels"


def test_every_package_folder_is_installed() -> None:
    # pyproject.toml lists the packages one by one: a new folder must be added there, or a
    # wheel ships without it (an editable install would still find it and hide the mistake).
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    setuptools_cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = setuptools_cfg.get("packages")
    if not isinstance(listed, list):
        pytest.skip("packages are discovered, not listed")
    on_disk = {
        ".".join(("asyncengine", *p.parent.relative_to(root / "asyncengine").parts))
        for p in (root / "asyncengine").rglob("__init__.py")
    }
    on_disk.add("asyncengine.kernels")
    on_disk |= {
        ".".join(("asyncengine.kernels", *p.parent.relative_to(root / "kernels").parts))
        for p in (root / "kernels").rglob("__init__.py")
    }
    missing = sorted(on_disk - set(listed))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.mark.timeout(60)
def test_dir_lists_the_public_names_only() -> None:
    import asyncengine

    names = dir(asyncengine)
    assert names == sorted(asyncengine.__all__)
    assert not {"Any", "TYPE_CHECKING", "annotations", "errors", "outputs"} & set(names)
    for name in names:  # every listed name resolves (the lazy ones included)
        getattr(asyncengine, name)
