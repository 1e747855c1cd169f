"""benchmarks/kernels.py runs; without a GPU, its interpreter smoke point agrees with torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark is a real run")
def test_benchmark_smoke_runs_without_a_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "No CUDA device" in proc.stdout
    assert "smoke check: ok" in proc.stdout
