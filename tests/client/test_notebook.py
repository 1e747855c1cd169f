"""docs/examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel (top-level await)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

NOTEBOOK = Path(__file__).resolve().parents[2] / "docs" / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("ASYNCENGINE_MODEL", str(tiny_llama))
    # The notebook leaves the device to the machine: its kernel sees no GPU, so it is the CPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "length" in text  # the first stream finished by max_tokens
    assert "KV blocks in use afterwards: 0 of" in text
    assert "running: 0," in text
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
