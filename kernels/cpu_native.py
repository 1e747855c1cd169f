"""Build, cache and load the native CPU kernels (`csrc/*.c`), and bind them through ctypes.

The C files (one per kernel family: attention, the cache write and rotary, norms, the MLP's
activation, argmax, decode-sized bf16 linear layers, LoRA's shrink and expand;
`csrc/ae_kernels.h` declares what each exports) are compiled into one library once per machine
with the system C compiler (`$CC`, else `cc`) for the host CPU (`-march=native -fopenmp`):
about a second, with no torch headers.
The library is cached under `cache_dir()/native/`, named by a hash of every source and header
(names and contents), the flags, the compiler binary and the CPU's feature flags, so a new
source, compiler or CPU builds a new one and a cache shared between different machines never
runs code built for another CPU. A build writes a temporary file and renames it, so processes
that build at once (tensor-parallel workers) do not see a half-written library.

`load_native()` returns None, after one warning, where no compiler works or
`ASYNCENGINE_NATIVE_KERNELS=0` is set; callers then use the torch reference.
`ASYNCENGINE_NATIVE_SANITIZE=address,undefined` (any `-fsanitize=` list) builds the library
with those sanitizers instead, as a library of its own in the cache, for tests: the process
must have the sanitizers' runtimes preloaded (tests/kernels/test_cpu_sanitizers.py).

`SIGNATURES` holds the ctypes signature of every C function Python calls, as ae_kernels.h
declares it (tests/kernels/test_cpu_bindings.py checks the two agree); the per-op modules
(`*_cpu.py`) call them through `require_native()`.

Threads: the library links `libgomp.so.1`, which resolves to the OpenMP runtime torch already
loaded (same soname), so one thread pool serves both. The thread count is passed per call,
because OpenMP's `omp_set_num_threads` (what `torch.set_num_threads` calls) is per thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.paths import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Every .c file is compiled into the one library; every file here is part of the build's hash.
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
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
# Sanitizers to build with, e.g. "address,undefined" (tests only; see the module docstring).
SANITIZE_ENV = "ASYNCENGINE_NATIVE_SANITIZE"
# How long one build may take, in seconds. About 9 s on 2 idle cores (20-30 s for a sanitized
# build); a machine busy with other work can take many times that.
BUILD_TIMEOUT_ENV = "ASYNCENGINE_NATIVE_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 600.0
# ae_kernels.h's enum ae_dtype.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_int, _i64, _float, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

# The C functions Python calls: name -> (return type, argument types), as ae_kernels.h
# declares them (every pointer is a void pointer here).
SIGNATURES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "ae_paged_attention": (_int, (
        _int,  # dtype code
        _ptr, _i64, _i64,  # query, token stride, head stride
        _ptr, _i64, _i64,  # out, token stride, head stride
        _ptr, _i64, _i64, _i64, _i64, _i64,  # cache, H_kv, blocks, block size, D, group
        _ptr, _ptr, _ptr,  # q_start (int64), q_lens, seq_lens (int32)
        _ptr, _i64, _i64,  # block_table (int32), its row stride, sequences
        _float, _int,  # scale, threads
    )),
    "ae_reshape_and_cache": (None, (
        _int,
        _ptr, _i64, _i64,  # key, token stride, head stride
        _ptr, _i64, _i64,  # value, token stride, head stride
        _ptr, _i64, _i64, _i64, _i64,  # cache, H_kv, blocks, block size, D
        _ptr, _i64, _int,  # slot_mapping, tokens, threads
    )),
    "ae_rotary": (None, (
        _int,
        _ptr, _i64, _i64, _i64,  # q, token stride, head stride, heads
        _ptr, _i64, _i64, _i64,  # k, token stride, head stride, heads
        _ptr, _ptr, _i64, _i64, _i64,  # cos, sin, their row stride, tokens, D
        _ptr, _ptr, _float,  # q_norm, k_norm weights (or NULL), eps
        _ptr, _i64, _i64,  # v, token stride, head stride (or NULL: no cache write)
        _ptr, _i64, _i64, _ptr,  # kv_cache (or NULL), blocks, block size, slot_mapping
        _int,  # threads
    )),
    "ae_rms_norm": (None, (
        _int,
        _ptr, _i64, _ptr, _i64,  # x, its row stride, out, its row stride
        _ptr, _i64, _i64, _float, _int,  # weight, rows, n, eps, threads
    )),
    "ae_add_rms_norm": (None, (
        _int,
        _ptr, _i64, _ptr, _i64, _ptr, _i64,  # x, residual (in place), out, their row strides
        _ptr, _i64, _i64, _float, _int,  # weight, rows, n, eps, threads
    )),
    "ae_silu_mul": (None, (
        _int,
        _ptr, _i64, _ptr, _i64, _ptr, _i64,  # gate, up, out, each with its row stride
        _i64, _i64, _int,  # rows, n, threads
    )),
    "ae_argmax_rows": (_i64, (  # -> rows holding a NaN
        _int,
        _ptr, _i64, _i64, _i64, _ptr, _int,  # x, row stride, rows, n, out (int64), threads
    )),
    "ae_apply_bitmask": (None, (
        _int,
        _ptr, _i64, _ptr, _i64,  # x, its row stride, row indices (int64), how many
        _ptr, _i64, _i64, _int,  # int32 bitmask, its row stride in words, n, threads
    )),
    "ae_linear_bf16_fast": (_int, ()),
    "ae_pool_test_delay_helpers": (_i64, (_i64,)),  # ns (tests: a preempted helper) -> taken over
    "ae_linear_bf16": (None, (
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64,  # packed weight, N, K, packed K
        _ptr, _ptr, _i64, _int,  # bias (or NULL), out, its row stride, threads
    )),
    "ae_linear_silu_bf16": (None, (
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64,  # packed joint [gate; up] weight, N (= 2I), K, packed K
        _ptr, _ptr, _i64, _int,  # bias (or NULL), out [rows][I], its row stride, threads
    )),
    "ae_linear_add_rms_norm_bf16": (None, (
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64, _i64, _ptr,  # packed weight, N, K, packed K, bias (or NULL)
        _ptr, _ptr, _i64,  # product scratch [rows][N], residual (in place), its row stride
        _ptr, _float, _ptr, _i64,  # norm weight, eps, out, its row stride
        _int,  # threads
    )),
    "ae_lm_head_argmax_bf16": (_i64, (
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _ptr, _ptr,  # the int8 copy: q [blocks][K][64], scale, rnorm (fp32 [blocks * 64])
        _ptr, _i64, _i64, _ptr,  # packed weight (as ae_linear_bf16), K, packed K, bias (or NULL)
        _i64, _ptr, _ptr, _i64,  # vocab (columns searched), temperatures, noise, its stride
        _ptr, _int,  # out (int64 [rows]), threads
    )),
    "ae_lm_head_quantize": (None, (
        _ptr, _i64, _i64, _i64,  # packed weight (as ae_linear_bf16), N, K, packed K
        _ptr, _ptr, _ptr, _int,  # q [blocks][K][64] int8, scale, rnorm (fp32 [blocks * 64])
    )),
    "ae_decode_layers_bf16": (_int, (
        _ptr, _i64, _i64, _i64,  # layers [L][AE_LAYER_FIELDS] (int64), L, tokens, hidden
        _i64, _i64, _i64, _i64,  # H_q, H_kv, D, intermediate
        _ptr, _ptr, _ptr,  # residual (in place), scratch, the last MLP output
        _ptr, _ptr, _i64, _ptr,  # cos, sin, their row stride, slot_mapping (int64)
        _i64, _i64,  # cache blocks, block size
        _ptr, _ptr, _ptr, _ptr, _i64, _i64,  # q_start, q_lens, seq_lens, block_table, its
        # row stride, sequences (as ae_paged_attention)
        _float, _float, _float,  # eps, head-norm eps, attention scale
        _ptr, _ptr, _i64, _ptr,  # LoRA: rows, seg_rows, segments, per segment its table
        _int,  # threads
    )),
    "ae_decode_layers_scratch": (_i64, (_i64, _i64, _i64, _i64, _i64, _i64)),
    "ae_lora_add": (_int, (
        _int, _ptr, _i64, _ptr, _i64, _i64,  # dtype code, x, its row stride, y, its, K
        _i64, _ptr, _ptr,  # parts, their first columns in y, their widths (int64)
        _ptr, _ptr, _i64,  # rows, seg_rows (int64), segments
        _ptr, _i64, _int,  # per segment its descriptors' address (int64), offset, threads
    )),
    "ae_linear_dense_simd": (_int, ()),
    "ae_linear_bf16_dense": (_int, (
        _ptr, _i64, _i64,  # x, its row stride, rows
        _ptr, _i64, _i64,  # weight in 16-row k-major panels (linear_dense_cpu.pack_dense), N, K
        _ptr, _ptr, _i64, _int,  # bias (or NULL), out, its row stride, threads
    )),
    "ae_dense_panel_order": (None, (_ptr,)),  # int32 [16]: where each column of a panel sits
    "ae_quant_paths": (_int, ()),  # bit p: path p built (quant_cpu.PATHS)
    # path (-1: the best built; -2: none, a query) -> the path in effect, or -1 (not built)
    "ae_quant_set_path": (_int, (_int,)),
    "ae_quantize_rows_q8": (None, (
        _int, _ptr, _i64, _i64, _i64,  # dtype code, x, its row stride, rows, K
        _ptr, _ptr, _int,  # qs (int8 [rows][K]), d (fp32 [rows][K / 32]), threads
    )),
    "ae_quantize_rows_q8k": (None, (  # as ae_quantize_rows_q8, one scale per 256 values
        _int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _int,
    )),
    "ae_pool_quiesce": (_int, (_int,)),  # timeout ms -> 1 when no helper is in an item
    "ae_pool_set_strict": (_int, (_int,)),  # on -> before (jobs wait for their helpers)
    "ae_omp_set_threads": (_int, (_int,)),  # this thread's OpenMP team size -> before
    "ae_quant_formats": (_int, ()),  # bit f: format code f runs (quant_formats.FORMATS)
    "ae_linear_quant": (_int, (
        _int, _int, _ptr, _i64, _i64,  # format code, dtype code, x, its row stride, rows
        _ptr, _i64, _i64,  # weight (GGUF blocks, N rows of K / values blocks), N, K
        _ptr, _ptr, _i64, _int,  # bias (or NULL), out, its row stride, threads
    )),
    "ae_quant_gemm": (_int, (
        _int, _int, _ptr, _i64, _i64,  # as ae_linear_quant
        _ptr, _i64, _i64,
        _ptr, _ptr, _i64, _int,
    )),
    "ae_quant_gemm_min_rows": (_int, (_int,)),  # format code
    "ae_quant_gemm_f32_min_rows": (_int, (_int,)),  # format code
    "ae_quant_gemm_f32_set": (_int, (_int,)),  # 1 on, 0 off, -1 the CPU's default, -2 query
    # interleaved format code, src, dst, N, K, threads
    "ae_repack_r8": (_int, (_int, _ptr, _ptr, _i64, _i64, _int)),
    "ae_unpack_r8": (_int, (_int, _ptr, _ptr, _i64, _i64, _int)),
    "ae_dequantize_quant": (_int, (
        _int, _ptr, _i64, _i64,  # format code, weight (GGUF blocks), N, K
        _int, _ptr, _i64, _int,  # dtype code, out, its row stride, threads
    )),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The loaded library's entry points (see ae_kernels.h and the C files for their contracts)."""

    path: Path
    paged_attention: Callable[..., int]
    reshape_and_cache: Callable[..., None]
    rotary: Callable[..., None]
    rms_norm: Callable[..., None]
    add_rms_norm: Callable[..., None]
    silu_mul: Callable[..., None]
    argmax_rows: Callable[..., int]
    apply_bitmask: Callable[..., None]
    linear_bf16: Callable[..., None]
    linear_silu_bf16: Callable[..., None]
    linear_add_rms_norm_bf16: Callable[..., None]
    # whether linear_bf16 runs on AVX512-BF16 dot products (else its portable fp32 loops)
    linear_bf16_fast: bool
    linear_bf16_dense: Callable[..., int]
    # whether linear_bf16_dense runs on AVX2 FMAs (else its scalar loops)
    linear_dense_simd: bool
    # where column j of a dense panel sits among the 16 values of one k (ae_dense_panel_order)
    dense_panel_order: tuple[int, ...]
    lm_head_argmax_bf16: Callable[..., int]
    lm_head_quantize: Callable[..., None]
    decode_layers_bf16: Callable[..., int]
    decode_layers_scratch: Callable[..., int]
    lora_add: Callable[..., int]
    # which quant_legacy.c paths were built (bit p: path p; see quant_cpu.PATHS)
    quant_paths: int
    quant_set_path: Callable[[int], int]
    quantize_rows_q8: Callable[..., None]
    quantize_rows_q8k: Callable[..., None]
    pool_quiesce: Callable[[int], int]
    pool_set_strict: Callable[[int], int]
    omp_set_threads: Callable[[int], int]
    # which formats ae_linear_quant runs (bit f: format code f; see quant_formats.FORMATS)
    quant_formats: int
    linear_quant: Callable[..., int]
    # quant_gemm.c's many-row product (tests call it directly), and from how many rows
    # linear_quant takes it on the VNNI path (0: never)
    quant_gemm: Callable[..., int]
    quant_gemm_min_rows: Callable[[int], int]
    # from how many rows quant_gemm multiplies in fp32, x unquantized (0: never)
    quant_gemm_f32_min_rows: Callable[[int], int]
    quant_gemm_f32_set: Callable[[int], int]
    dequantize_quant: Callable[..., int]
    # Q4_K / Q8_0 / Q5_0 / Q4_0 rows to their 8-row interleaved format (csrc/quant_r8.c) and
    # back, the interleaved format's code first
    repack_r8: Callable[..., int]
    unpack_r8: Callable[..., int]
    # tests: linear.c's pool helpers sleep this many ns after claiming an item (0: off); gives
    # how many items the caller took over from helpers since the last call
    pool_test_delay_helpers: Callable[[int], int]


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
        global _unavailable_reason
        _unavailable_reason = f"building the native CPU kernels failed: {e}"
        logger.warning("%s; using the slower torch path", _unavailable_reason)
        return None
    return _bind(lib, path)


_unavailable_reason = "no C compiler found ($CC or cc)"


def unavailable_reason() -> str:
    """Why `load_native()` gave None (for messages and test skips): no compiler, turned off,
    or the build's own error (a timeout says so, with its duration)."""
    if not native_enabled():
        return f"the native kernels are turned off ({DISABLE_ENV}=0)"
    return _unavailable_reason


def require_native() -> NativeKernels:
    """`load_native()`, for callers that were only chosen because it is available."""
    lib = load_native()
    if lib is None:
        raise RuntimeError("the native CPU kernels are unavailable (see the earlier warning)")
    return lib


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CPU, one supported dtype, rows of stride 1."""
    dtype = tensors[0].dtype
    return all(
        t.device.type == "cpu" and t.dtype == dtype and t.dtype in DTYPE_CODES and t.stride(-1) == 1
        for t in tensors
    )


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [R, N] rows of unit stride along N (a view where it can be): the kernels
    take any row stride."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _function(lib: ctypes.CDLL, name: str) -> Callable[..., None]:
    """The library's C function `name`, with its signature (SIGNATURES) declared."""
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = SIGNATURES[name][0], list(SIGNATURES[name][1])
    return fn  # type: ignore[no-any-return]


def _bind(lib: ctypes.CDLL, path: Path) -> NativeKernels:
    return NativeKernels(
        path=path,
        paged_attention=_function(lib, "ae_paged_attention"),  # type: ignore[arg-type]
        reshape_and_cache=_function(lib, "ae_reshape_and_cache"),
        rotary=_function(lib, "ae_rotary"),
        rms_norm=_function(lib, "ae_rms_norm"),
        add_rms_norm=_function(lib, "ae_add_rms_norm"),
        silu_mul=_function(lib, "ae_silu_mul"),
        argmax_rows=_function(lib, "ae_argmax_rows"),  # type: ignore[arg-type]
        apply_bitmask=_function(lib, "ae_apply_bitmask"),
        linear_bf16=_function(lib, "ae_linear_bf16"),
        linear_silu_bf16=_function(lib, "ae_linear_silu_bf16"),
        linear_add_rms_norm_bf16=_function(lib, "ae_linear_add_rms_norm_bf16"),
        linear_bf16_fast=bool(_function(lib, "ae_linear_bf16_fast")()),
        linear_bf16_dense=_function(lib, "ae_linear_bf16_dense"),  # type: ignore[arg-type]
        linear_dense_simd=bool(_function(lib, "ae_linear_dense_simd")()),
        dense_panel_order=_panel_order(_function(lib, "ae_dense_panel_order")),
        lm_head_argmax_bf16=_function(lib, "ae_lm_head_argmax_bf16"),  # type: ignore[arg-type]
        lm_head_quantize=_function(lib, "ae_lm_head_quantize"),
        decode_layers_bf16=_function(lib, "ae_decode_layers_bf16"),  # type: ignore[arg-type]
        decode_layers_scratch=_function(lib, "ae_decode_layers_scratch"),  # type: ignore[arg-type]
        lora_add=_function(lib, "ae_lora_add"),  # type: ignore[arg-type]
        pool_test_delay_helpers=_function(lib, "ae_pool_test_delay_helpers"),  # type: ignore[arg-type]
        quant_paths=int(_function(lib, "ae_quant_paths")()),  # type: ignore[func-returns-value,call-overload]
        quant_set_path=_function(lib, "ae_quant_set_path"),  # type: ignore[arg-type]
        quantize_rows_q8=_function(lib, "ae_quantize_rows_q8"),
        quantize_rows_q8k=_function(lib, "ae_quantize_rows_q8k"),
        pool_quiesce=_function(lib, "ae_pool_quiesce"),  # type: ignore[arg-type]
        pool_set_strict=_function(lib, "ae_pool_set_strict"),  # type: ignore[arg-type]
        omp_set_threads=_function(lib, "ae_omp_set_threads"),  # type: ignore[arg-type]
        quant_formats=int(_function(lib, "ae_quant_formats")()),  # type: ignore[func-returns-value,call-overload]
        linear_quant=_function(lib, "ae_linear_quant"),  # type: ignore[arg-type]
        quant_gemm=_function(lib, "ae_quant_gemm"),  # type: ignore[arg-type]
        quant_gemm_min_rows=_function(lib, "ae_quant_gemm_min_rows"),  # type: ignore[arg-type]
        quant_gemm_f32_min_rows=_function(lib, "ae_quant_gemm_f32_min_rows"),  # type: ignore[arg-type]
        quant_gemm_f32_set=_function(lib, "ae_quant_gemm_f32_set"),  # type: ignore[arg-type]
        dequantize_quant=_function(lib, "ae_dequantize_quant"),  # type: ignore[arg-type]
        repack_r8=_function(lib, "ae_repack_r8"),  # type: ignore[arg-type]
        unpack_r8=_function(lib, "ae_unpack_r8"),  # type: ignore[arg-type]
    )


def _panel_order(function: Callable[..., None]) -> tuple[int, ...]:
    slots = (ctypes.c_int32 * 16)()
    function(slots)
    return tuple(slots)


def _build_flags() -> tuple[str, ...]:
    """The compiler flags of this process's build: CFLAGS with $ASYNCENGINE_NATIVE_MARCH's
    -march, plus the sanitizers of $ASYNCENGINE_NATIVE_SANITIZE (which stop at the first
    error they find, and keep frame pointers and line numbers for their reports)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in CFLAGS)
    sanitize = os.environ.get(SANITIZE_ENV, "").strip()
    if sanitize:
        # -O1, as the sanitizers' own docs advise: -O3 took the quantized kernels' files
        # three times as long to build (minutes) for no more that the sanitizers see.
        flags = tuple("-O1" if f == "-O3" else f for f in flags)
        flags += (f"-fsanitize={sanitize}", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer", "-g")  # fmt: skip
    return flags


def _build(cc: str) -> Path:
    flags = _build_flags()
    key = hashlib.sha256()
    files = [part for p in (*SOURCES, *HEADERS) for part in (p.name.encode(), p.read_bytes())]
    for part in (*files, " ".join(flags).encode(), _compiler_identity(cc), _cpu_flags()):
        key.update(part)
        key.update(b"\0")
    out_dir = cache_dir() / "native"
    # A sanitized build is a library of its own: the two never replace each other.
    stem = "cpu_kernels-sanitized" if os.environ.get(SANITIZE_ENV, "").strip() else "cpu_kernels"
    prefix = f"{stem}-{platform.machine()}-"
    target = out_dir / f"{prefix}{key.hexdigest()[:16]}.so"
    if target.is_file():
        with contextlib.suppress(OSError):
            os.utime(target)  # recently used: kept by the pruning below
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    timeout = _build_timeout()
    # The first run on a machine is otherwise silent for as long as the build takes.
    print(
        f"asyncengine: building the native CPU kernels with {cc} (once; about 25 s on 2 idle "
        f"cores), cached in {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix="objects-") as objects:
            _compile_and_link(cc, flags, Path(objects), Path(tmp), timeout)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune_builds(out_dir, prefix, keep=KEPT_BUILDS)
    logger.info("built the native CPU kernels: %s", target)
    return target


def _compile_and_link(cc: str, flags: tuple[str, ...], objects: Path, out: Path,
                      timeout: float) -> None:  # fmt: skip
    """Compile every source to an object in `objects`, as many at once as this process may
    use cores, largest first (the quantized-kernel files take most of the time: sanitized,
    minutes), then link them into `out`. Raises OSError with the compiler's complaint, or when
    the whole build outlasts `timeout` seconds."""
    started = time.monotonic()
    compile_flags = tuple(f for f in flags if f != "-shared")
    sources = sorted(SOURCES, key=lambda p: p.stat().st_size, reverse=True)

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        left = timeout - (time.monotonic() - started)
        return subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, left))

    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs or 1)) as pool:
            results = pool.map(
                run,
                [[cc, *compile_flags, "-c", "-o", str(objects / f"{p.stem}.o"), str(p)]
                 for p in sources],
            )  # fmt: skip
            for path, result in zip(sources, results, strict=True):
                if result.returncode != 0:
                    raise OSError(
                        f"{cc} exited with {result.returncode} on {path.name}: "
                        f"{result.stderr.strip()[-2000:]}"
                    )
        result = run([cc, *flags, "-o", str(out), *(str(objects / f"{p.stem}.o") for p in sources)])
        if result.returncode != 0:
            raise OSError(f"{cc} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
    except subprocess.TimeoutExpired:
        raise OSError(
            f"{cc} timed out after {time.monotonic() - started:.0f} s (limit {timeout:g} s; "
            f"a busy machine builds slowly: set {BUILD_TIMEOUT_ENV} to wait longer)"
        ) from None


def _build_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        logger.warning("%s=%r is not a number of seconds > 0; using %s", BUILD_TIMEOUT_ENV, raw,
                       DEFAULT_BUILD_TIMEOUT_S)  # fmt: skip
        return DEFAULT_BUILD_TIMEOUT_S
    return value


# Builds kept per kind: several checkouts (or versions) on one machine each keep theirs,
# instead of evicting each other's and rebuilding at every start.
KEPT_BUILDS = 4


def prune_builds(out_dir: Path, prefix: str, keep: int) -> None:
    """Remove all but the `keep` most recently used builds named `prefix*.so` (a process
    still running a removed one keeps its mapping)."""
    builds = sorted(out_dir.glob(f"{prefix}*.so"), key=_mtime, reverse=True)
    for old in builds[keep:]:
        old.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


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
