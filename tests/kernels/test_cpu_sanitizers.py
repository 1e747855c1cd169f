"""The native kernels' tests once more, on a library built with AddressSanitizer and
UndefinedBehaviorSanitizer: an out-of-bounds read or write, a use after free, or undefined
behaviour in the C code fails the run at its first occurrence, with a report.

Python is not built with ASan, so the sanitizers' runtimes are preloaded (LD_PRELOAD) into a
child pytest process, which builds its own library (ASYNCENGINE_NATIVE_SANITIZE; cached beside
the normal one: a minute the first time, then seconds). Leak detection is off: the interpreter
itself leaks by design. The child sees no GPU (CUDA_VISIBLE_DEVICES=""): the tests it runs are
of the CPU, and on a machine with a GPU it failed as CUDA started (its conftest asks
`torch.cuda.is_available()`): the CUDA driver does not start under AddressSanitizer's default
options (it maps memory where ASan keeps its shadow gap).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.kernels import cpu_native

REPO = Path(__file__).resolve().parents[2]
# The kernels' own tests, and the model tests of the fused linear kernels; not the portable
# build's (a second sanitized library for no more coverage).
TESTS = [
    "tests/kernels/test_argmax_cpu.py",
    "tests/kernels/test_bitmask_cpu.py",
    "tests/kernels/test_linear_cpu.py",
    "tests/kernels/test_paged_attention_cpu.py",
    "tests/kernels/test_reshape_and_cache_cpu.py",
    "tests/kernels/test_rms_norm_cpu.py",
    "tests/kernels/test_rotary_cpu.py",
    "tests/kernels/test_silu_mul_cpu.py",
    "tests/kernels/test_linear_dense_cpu.py",
    "tests/kernels/test_lm_head_argmax.py",
    "tests/kernels/test_quant_cpu.py",
    "tests/kernels/test_quant_kquants.py",
    "tests/kernels/test_quant_dequant.py",
    "tests/kernels/test_quant_gemm.py",
    "tests/kernels/test_quant_r8.py",
    "tests/kernels/test_quant_q5_0_bytes.py",
    "tests/kernels/test_lora_cpu.py",
    "tests/model/test_decode_layers.py::test_native_layers_give_the_python_loops_numbers",
    "tests/model/test_cpu_linear.py::test_fused_gate_up_silu_is_the_two_steps_bit_for_bit",
    "tests/model/test_cpu_linear.py::test_fused_projection_add_rms_norm_is_the_two_steps_bit_for_bit",
    "tests/model/test_lora_native.py",
]


CPU_FEATURE_SKIPS = (
    "no oneDNN bf16 on this CPU",
    "the native kernel's fast path is not built",
    "built without AVX2 and FMA",
    "oneDNN packs bf16 in another layout on this CPU",
    "this CPU has no AVX512-VNNI",
)


def _runtime(cc: str, name: str) -> str | None:
    """The sanitizer runtime library `name` of compiler `cc`, or None where it has none."""
    proc = subprocess.run(
        [cc, f"-print-file-name={name}"], capture_output=True, text=True, check=False
    )
    path = proc.stdout.strip()
    return path if proc.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.timeout(900)
def test_native_kernel_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    cc = cpu_native.compiler()
    if cc is None or not cpu_native.native_enabled():
        pytest.skip("no C compiler, or the native kernels are turned off")
    runtimes = [_runtime(cc, "libasan.so"), _runtime(cc, "libubsan.so")]
    if None in runtimes:
        pytest.skip(f"{cc} has no libasan / libubsan to preload")
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=":".join([*runtimes, *filter(None, [env.get("LD_PRELOAD")])]),  # type: ignore[list-item]
        # Reports to files: a report on stderr dies with the child pytest's capture of it
        # when the sanitizer ends the process.
        # No fake stack frames (use-after-return checks, on by default since GCC 13's libasan):
        # GCC 13.3 places 64-byte vector locals misaligned in them, and an AVX-512 build then
        # faults on its aligned moves (seen in argmax.c's fp16 load on an H200 machine's CPU).
        ASAN_OPTIONS=f"detect_leaks=0:detect_stack_use_after_return=0:log_path={tmp_path / 'asan'}",
        CUDA_VISIBLE_DEVICES="",
        UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:log_path={tmp_path / 'ubsan'}",
        **{cpu_native.SANITIZE_ENV: "address,undefined"},
    )
    # A loaded machine (a full test run beside other work) builds the sanitized library
    # slowly: give it the whole test's time rather than fail on a build timeout.
    env.setdefault(cpu_native.BUILD_TIMEOUT_ENV, "800")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-x", "-p", "no:cacheprovider",
         "-p", "no:benchmark", "-k",
         "not portable_build", *TESTS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    reports = "".join(p.read_text(errors="replace")[-6000:] for p in sorted(tmp_path.iterdir()))
    output = proc.stdout[-6000:] + proc.stderr[-6000:] + reports
    assert not reports, output
    assert proc.returncode == 0, output
    assert "passed" in proc.stdout, output
    # Skipped only where this CPU lacks what a test needs (AVX512-BF16: oneDNN's bf16 and the
    # packed kernels' fast path); anything else means the sanitizers did not see that code.
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    unexpected = [line for line in skips if not any(r in line for r in CPU_FEATURE_SKIPS)]
    assert not unexpected, output
