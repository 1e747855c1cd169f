"""Every Triton kernel compiles for an H100 (sm_90) as its wrapper launches it, with no GPU.

The interpreter runs the kernels' arithmetic but not Triton's compiler; this runs the compiler
(in a subprocess, since this process imported the kernels for the interpreter) down to a cubin
and checks each launch's shared memory. See compile_for_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("compile_for_cuda.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests run compiled")
@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for kernel in ("_decode_kernel", "_reduce_splits_kernel", "_prefill_kernel"):
        assert any(kernel in line for line in lines), kernel
    assert all(line.endswith(" ok") for line in lines)
