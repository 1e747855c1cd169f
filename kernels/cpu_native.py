"""Build, cache and load the native CPU kernels (`csrc/*.c`), called through ctypes.

The C files (attention, norms and the other small kernels in `cpu_kernels.c`; decode-sized
bf16 linear layers, with variants fused with what follows them, in `cpu_linear.c`: a gated
MLP's SiLU-and-multiply, the residual add and RMSNorm after a projection) are compiled into
one library once per machine with the system C compiler (`$CC`, else `cc`) for the host CPU
(`-march=native -fopenmp`): about a second, with no torch headers. The library is cached
under `cache_dir()/native/`, named by a hash of the sources, the flags, the compiler binary
and the CPU's feature flags, so a new source, compiler or CPU builds a new one and a cache
shared between different machines never runs code built for another CPU. A build writes a
temporary file and renames it, so processes that build at once (tensor-parallel workers) do
not see a half-written library.

`load_native()` returns None, after one warning, where no compiler works or
`ASYNCENGINE_NATIVE_KERNELS=0` is set; callers then use the torch reference.

Threads: the library links `libgomp.so.1`, which resolves to the OpenMP runtime torch already
loaded (same soname), so one thread pool serves both. The thread count is passed per call,
because OpenMP's `omp_set_num_threads` (what `torch.set_num_threads` calls) is per thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.paths import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Compiled together into one library; the header is part of the build's hash.
SOURCES = (CSRC / "cpu_kernels.c", CSRC / "cpu_linear.c")
HEADERS = (CSRC / "bf16.h", CSRC / "fast_exp.h")
# -fno-trapping-math lets GCC vectorise the clamped exp() loops (FP exception flags are unused).
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-fno-trapping-math",
)
DISABLE_ENV = "ASYNCENGINE_NATIVE_KERNELS"
# -march for the build, "native" unless set: e.g. "x86-64-v3" for a cache shared between
# machines, or "x86-64" to exercise the kernels' portable (non-AVX-512) code paths.
MARCH_ENV = "ASYNCENGINE_NATIVE_MARCH"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The loaded library's entry points (see the C file for their contracts)."""

    path: Path
    paged_attention: Callable[..., None]
    reshape_and_cache: Callable[..., None]
    rms_norm: Callable[..., None]
    add_rms_norm: Callable[..., None]
    rotary: Callable[..., None]
    silu_mul: Callable[..., None]
    argmax_rows: Callable[..., None]
    linear_bf16: Callable[..., None]
    linear_silu_bf16: Callable[..., None]
    linear_add_rms_norm_bf16: Callable[..., None]
    # whether linear_bf16 runs on AVX512-BF16 dot products (else its portable fp32 loops)
    linear_bf16_fast: bool


def compiler() -> str | None:
    """The C compiler to use: `$CC`, else `cc` on PATH; None where there is none."""
    return shutil.which(os.environ.get("CC") or "cc")


def native_enabled() -> bool:
    """False when the user turned the native kernels off (`ASYNCENGINE_NATIVE_KERNELS=0`)."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def load_native() -> NativeKernels | None:
    """The native kernels, built on first use; None (after one warning) where they can't be."""
    if not native_enabled():
        return None
    cc = compiler()
    if cc is None:
        logger.warning(
            "no C compiler found ($CC or cc): using the slower torch attention on CPU; "
            "install gcc (or set CC) for asyncengine's native CPU kernels"
        )
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building the native CPU kernels failed, using torch attention: %s", e)
        return None
    return _bind(lib, path)


def require_native() -> NativeKernels:
    """`load_native()`, for callers that were only chosen because it is available."""
    lib = load_native()
    if lib is None:
        raise RuntimeError("the native CPU kernels are unavailable (see the earlier warning)")
    return lib


def _function(lib: ctypes.CDLL, name: str, argtypes: list[object]) -> Callable[..., None]:
    """The library's C function `name` (returning void), with its argument types declared."""
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = argtypes
    return fn  # type: ignore[no-any-return]


def _bind(lib: ctypes.CDLL, path: Path) -> NativeKernels:
    attention = _function(lib, "ae_paged_attention", [
        ctypes.c_int,  # dtype code
        _ptr, _i64, _i64,  # query, token stride, head stride
        _ptr, _i64, _i64,  # out, token stride, head stride
        _ptr, _i64, _i64, _i64, _i64, _i64,  # cache, H_kv, blocks, block size, D, group
        _ptr, _ptr, _ptr,  # q_start (int64), q_lens, seq_lens (int32)
        _ptr, _i64, _i64,  # block_table (int32), its row stride, sequences
        ctypes.c_float, ctypes.c_int,  # scale, threads
    ])  # fmt: skip
    cache = _function(lib, "ae_reshape_and_cache", [
        ctypes.c_int,
        _ptr, _i64, _i64,  # key, token stride, head stride
        _ptr, _i64, _i64,  # value, token stride, head stride
        _ptr, _i64, _i64, _i64, _i64,  # cache, H_kv, blocks, block size, D
        _ptr, _i64, ctypes.c_int,  # slot_mapping, tokens, threads
    ])  # fmt: skip
    rms_norm = _function(lib, "ae_rms_norm", [
        ctypes.c_int,
        _ptr, _i64, _ptr, _i64,  # x, its row stride, out, its row stride
        _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int,  # weight, rows, n, eps, threads
    ])  # fmt: skip
    add_rms_norm = _function(lib, "ae_add_rms_norm", [
        ctypes.c_int,
        _ptr, _i64, _ptr, _i64, _ptr, _i64,  # x, residual (in place), out, their row strides
        _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int,  # weight, rows, n, eps, threads
    ])  # fmt: skip
    rotary = _function(lib, "ae_rotary", [
        ctypes.c_int,
        _ptr, _i64, _i64, _i64,  # q, token stride, head stride, heads
        _ptr, _i64, _i64, _i64,  # k, token stride, head stride, heads
        _ptr, _ptr, _i64, _i64, _i64,  # cos, sin, their row stride, tokens, D
        _ptr, _ptr, ctypes.c_float,  # q_norm, k_norm weights (or NULL), eps
        _ptr, _i64, _i64,  # v, token stride, head stride (or NULL: no cache write)
        _ptr, _i64, _i64, _ptr,  # kv_cache (or NULL), blocks, block size, slot_mapping
        ctypes.c_int,  # threads
    ])  # fmt: skip
    silu_mul = _function(lib, "ae_silu_mul", [
        ctypes.c_int,
        _ptr, _i64, _ptr, _i64, _ptr, _i64,  # gate, up, out, each with its row stride
        _i64, _i64, ctypes.c_int,  # rows, n, threads
    ])  # fmt: skip
    argmax_rows = _function(lib, "ae_argmax_rows", [
        ctypes.c_int,
        _ptr, _i64, _i64, _i64, _ptr, ctypes.c_int,  # x, row stride, rows, n, out, threads
    ])  # fmt: skip
    linear_bf16 = _function(lib, "ae_linear_bf16", [
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64,  # packed weight, N, K, packed K
        _ptr, _ptr, _i64, ctypes.c_int,  # bias (or NULL), out, its row stride, threads
    ])  # fmt: skip
    linear_silu_bf16 = _function(lib, "ae_linear_silu_bf16", [
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64,  # packed joint [gate; up] weight, N (= 2I), K, packed K
        _ptr, _ptr, _i64, ctypes.c_int,  # bias (or NULL), out [rows][I], its row stride, threads
    ])  # fmt: skip
    linear_add_rms_norm_bf16 = _function(lib, "ae_linear_add_rms_norm_bf16", [
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64, _ptr,  # packed weight, N, K, packed K, bias (or NULL)
        _ptr, _ptr, _i64,  # product scratch [rows][N], residual (in place), its row stride
        _ptr, ctypes.c_float, _ptr, _i64,  # norm weight, eps, out, its row stride
        ctypes.c_int,  # threads
    ])  # fmt: skip
    fast = lib.ae_linear_bf16_fast
    fast.restype, fast.argtypes = ctypes.c_int, []
    return NativeKernels(
        path=path,
        linear_bf16=linear_bf16,
        linear_silu_bf16=linear_silu_bf16,
        linear_add_rms_norm_bf16=linear_add_rms_norm_bf16,
        linear_bf16_fast=bool(fast()),
        argmax_rows=argmax_rows,
        paged_attention=attention,
        reshape_and_cache=cache,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        rotary=rotary,
        silu_mul=silu_mul,
    )


def _build(cc: str) -> Path:
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in CFLAGS)
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*sources, " ".join(flags).encode(), _compiler_identity(cc), _cpu_flags()):
        key.update(part)
        key.update(b"\0")
    out_dir = cache_dir() / "native"
    target = out_dir / f"cpu_kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, *(str(path) for path in SOURCES)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise OSError(f"{cc} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    # Builds of older sources are dead weight (a process still running one keeps its mapping).
    for old in out_dir.glob(f"cpu_kernels-{platform.machine()}-*.so"):
        if old != target:
            old.unlink(missing_ok=True)
    logger.info("built the native CPU kernels: %s", target)
    return target


def _compiler_identity(cc: str) -> bytes:
    # The resolved binary's identity stands in for `cc --version`, which would cost a
    # subprocess at every engine start: an upgraded compiler is another file.
    try:
        real = os.path.realpath(cc)
        st = os.stat(real)
    except OSError:
        return b""
    return f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()


def _cpu_flags() -> bytes:
    # -march=native code may use any of these; another CPU must get its own build.
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return platform.processor().encode()
