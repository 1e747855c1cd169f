"""Kernel tests. The native CPU kernels' tests (`test_*_cpu.py`, `test_cpu_*.py`) need a C
compiler (they skip without one); the Triton kernels' need triton (their files are left out
without it).

The Triton kernels run compiled on CUDA when a GPU is present, else under Triton's interpreter.
`@triton.jit` decides between the two when a kernel module is imported, so one test process
runs one of them: on a GPU-less machine this sets TRITON_INTERPRET=1 before any test module
imports a kernel. Tests that take a `device` argument get "cuda" (marked `gpu`) or "cpu"
(interpreted), whichever this process can run; the other is skipped (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = [
        "test_*_triton.py",
        "test_compile_for_cuda.py",
        "test_benchmark_smoke.py",
    ]

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
