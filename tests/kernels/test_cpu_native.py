"""Building, caching and loading the native CPU kernels (kernels/cpu_native.py), and how the
C code is built: warning-free, its portable (non-AVX-512) paths working, its inner-loop helpers
inlined."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import cpu_native
from asyncengine.kernels.argmax_cpu import argmax_cpu
from asyncengine.kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu
from asyncengine.kernels.reshape_and_cache_cpu import reshape_and_cache_cpu, to_cpu_layout
from asyncengine.testing.paged_batches import dense_attention, make_paged_batch

pytestmark = pytest.mark.skipif(
    cpu_native.load_native() is None, reason=cpu_native.unavailable_reason()
)


def test_build_is_cached_per_source_and_a_broken_compiler_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None and lib.path.parent == tmp_path / "native"
        assert [p.name for p in lib.path.parent.iterdir()] == [lib.path.name]  # no temp file
        cpu_native.load_native.cache_clear()
        again = cpu_native.load_native()  # found in the cache: no rebuild
        assert again is not None and again.path == lib.path
        # A compiler that fails (and no cached library for this new "compiler"): torch path.
        monkeypatch.setenv("CC", "false")
        monkeypatch.setattr(cpu_native, "_compiler_identity", lambda cc: b"broken")
        cpu_native.load_native.cache_clear()
        with caplog.at_level("WARNING"):
            assert cpu_native.load_native() is None
        assert "building the native CPU kernels failed" in caplog.text
    finally:
        cpu_native.load_native.cache_clear()


def test_a_slow_build_is_reported_as_a_timeout_with_its_duration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.BUILD_TIMEOUT_ENV, "0.01")
    cpu_native.load_native.cache_clear()
    try:
        assert cpu_native.load_native() is None
        reason = cpu_native.unavailable_reason()
        assert "timed out after" in reason and "limit 0.01 s" in reason, reason
        assert cpu_native.BUILD_TIMEOUT_ENV in reason
        # The build announced itself first: a first run is not silent while it compiles.
        assert "building the native CPU kernels" in capsys.readouterr().err
    finally:
        cpu_native.load_native.cache_clear()


def test_the_cache_key_covers_every_source_and_header() -> None:
    csrc = Path(cpu_native.__file__).parent / "csrc"
    assert set(cpu_native.SOURCES) == set(csrc.glob("*.c"))
    assert set(cpu_native.HEADERS) == set(csrc.glob("*.h"))
    assert {p.name for p in cpu_native.SOURCES} >= {"attention.c", "norms.c", "linear.c"}


@pytest.mark.parametrize("march", ["native", "x86-64"])
def test_the_c_code_builds_without_warnings(march: str, tmp_path: Path) -> None:
    # -Wall -Werror, on the build's own flags, both for this CPU and for the portable paths.
    # (-Wno-psabi: GCC notes that 64-byte vectors change the ABI of functions without AVX-512;
    # every function that takes or returns one is inlined.)
    if march != "native" and platform.machine() != "x86_64":
        pytest.skip("x86-64 -march names")
    cc = cpu_native.compiler()
    assert cc is not None
    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_native.CFLAGS]
    proc = subprocess.run(
        [cc, *flags, "-Wall", "-Werror", "-Wno-psabi", "-o", str(tmp_path / "k.so"),
         *map(str, cpu_native.SOURCES)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march names")
def test_portable_build_without_avx512(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The AVX-512 paths are #ifdef'd; this machine would never run the others otherwise.
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64")
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None
        x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        x[2, 1001] = float("nan")
        assert torch.equal(argmax_cpu(x), x.float().argmax(dim=-1))
        b = make_paged_batch([1, 1, 4], [40, 17, 30], 6, 2, 64, 16, torch.bfloat16, seed=5)
        cache = to_cpu_layout(b.base_cache)
        reshape_and_cache_cpu(b.key, b.value, cache, b.slot_mapping)
        plan = plan_paged_attention_cpu(
            b.query_start_loc, b.seq_lens, b.block_table, 16, b.query.dtype
        )
        out = paged_attention_cpu(b.query, b.key, b.value, cache, plan, 0.125)
        assert float((out.float() - dense_attention(b, 0.125)).abs().max()) <= 1.6e-2
    finally:
        cpu_native.load_native.cache_clear()


# ae_vec.h's, bf16.h's and fast_exp.h's helpers, inlined into every file that includes them.
INLINE_HELPERS = (
    *("load16_as_f32", "load16", "load_f32", "store_f32", "exp2_normal", "round_row"),
    *("elem_size", "round16_bf16_bits", "round16_bf16", "store16_bf16"),
    *("bf16_to_f32", "f32_to_bf16", "exp_nonpositive", "exp_any", "silu_f32"),
)


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils)")
def test_inner_loop_helpers_are_inlined() -> None:
    # GCC once stopped inlining these as the file grew, which made the attention ~2x slower:
    # a call per 16 values. They are forced inline now; no symbol of theirs may be left.
    lib = cpu_native.require_native()
    listing = subprocess.run(["nm", str(lib.path)], capture_output=True, text=True, check=True)
    names = {line.split()[-1].split(".")[0] for line in listing.stdout.splitlines() if line}
    assert not names & set(INLINE_HELPERS)


def test_the_build_cache_keeps_the_most_recently_used_builds(tmp_path: Path) -> None:
    import os

    from asyncengine.kernels.cpu_native import prune_builds

    for age in range(6):  # build-0 is the newest
        build = tmp_path / f"cpu_kernels-x86_64-build{age}.so"
        build.write_bytes(b"")
        os.utime(build, (1_000_000 - age, 1_000_000 - age))
    other = tmp_path / "cpu_kernels-sanitized-x86_64-old.so"  # another kind: never touched
    other.write_bytes(b"")
    prune_builds(tmp_path, "cpu_kernels-x86_64-", keep=4)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [other.name, *(f"cpu_kernels-x86_64-build{i}.so" for i in range(4))]
