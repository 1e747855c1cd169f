"""Decode attention: the Triton kernel's achieved memory bandwidth, against a torch reference.

    python benchmarks/kernels.py [--batch 64] [--context 2048] [--head-dim 128]
                                 [--q-heads 32] [--kv-heads 8] [--block-size 16]
                                 [--dtype bfloat16] [--no-sweep] [--json out.json]

On CUDA, for each point (the target: batch 64, context 2048, head size 128; then, unless
`--no-sweep`, longer contexts at smaller batches, where split-K decoding matters) it times
`paged_attention_triton` on a batch of decodes over a paged cache with shuffled blocks, and
reports:

- achieved GB/s: the bytes a decode step must move (every cached K/V row once, the queries,
  outputs and block table) over the median time, and that as a percentage of the device's peak
  memory bandwidth (from its memory clock and bus width; `--peak-gbs` overrides) and of a
  device-to-device copy's measured bandwidth;
- time against two torch references: gather-then-SDPA (index_select the blocks, then
  `scaled_dot_product_attention` with GQA) and asyncengine's torch backend;
- the largest difference between the Triton and gather-then-SDPA outputs.

Target at the main point: >= 70% of peak memory bandwidth. Timings use
`triton.testing.do_bench` (median, L2 flushed between runs).

Without CUDA there is nothing to measure: the script says so and runs one tiny point under
Triton's interpreter to check that the benchmark and kernel run and agree; those timings are
an interpreter's and say nothing about GPU performance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Before the kernels are imported: @triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if __package__ in (None, ""):  # run as a script: make `asyncengine` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncengine.kernels.paged_attention import (  # noqa: E402
    paged_attention_torch,
    plan_paged_attention_torch,
)
from asyncengine.kernels.paged_attention_triton import (  # noqa: E402
    paged_attention_triton,
    plan_paged_attention_triton,
)


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int
    context: int
    head_dim: int
    q_heads: int
    kv_heads: int
    block_size: int
    dtype: str


@dataclasses.dataclass
class Result:
    point: Point
    triton_us: float
    gbs: float
    pct_peak: float | None
    pct_copy: float | None
    sdpa_us: float
    torch_backend_us: float
    max_abs_diff: float


@dataclasses.dataclass
class DecodeBatch:
    query: torch.Tensor  # [B, H_q, D]
    kv_cache: torch.Tensor  # [2, H_kv, num_blocks, block_size, D]
    block_table: torch.Tensor  # [B, blocks_per_seq]
    query_start_loc: list[int]
    seq_lens: list[int]


def make_batch(p: Point, device: torch.device) -> DecodeBatch:
    dtype = getattr(torch, p.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = math.ceil(p.context / p.block_size)
    num_blocks = p.batch * blocks_per_seq
    shape = (2, p.kv_heads, num_blocks, p.block_size, p.head_dim)
    kv_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
    # Shuffled blocks, as a long-running cache hands them out.
    order = torch.randperm(num_blocks, generator=g, device=device)
    block_table = order.view(p.batch, blocks_per_seq)
    query = torch.randn(p.batch, p.q_heads, p.head_dim, generator=g, device=device, dtype=dtype)
    return DecodeBatch(
        query, kv_cache, block_table, list(range(p.batch + 1)), [p.context] * p.batch
    )


def gather_then_sdpa(b: DecodeBatch, scale: float) -> torch.Tensor:  # [B, H_q, D]
    """The plain torch way: gather each sequence's blocks into dense K/V, then SDPA."""
    _, kv_heads, _, block_size, head_dim = b.kv_cache.shape
    batch, blocks_per_seq = b.block_table.shape
    kv = b.kv_cache.index_select(2, b.block_table.reshape(-1))  # [2, H_kv, B * nb, bs, D]
    kv = kv.view(2, kv_heads, batch, blocks_per_seq * block_size, head_dim)
    k = kv[0].transpose(0, 1)[:, :, : b.seq_lens[0]]  # [B, H_kv, S, D] (equal lengths)
    v = kv[1].transpose(0, 1)[:, :, : b.seq_lens[0]]
    out = F.scaled_dot_product_attention(
        b.query[:, :, None], k, v, scale=scale, enable_gqa=True
    )  # [B, H_q, 1, D]
    return out[:, :, 0]


def decode_bytes(p: Point) -> int:
    """What one decode step must move: each cached K and V row once, plus Q, O, block table."""
    elem = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
    kv = 2 * p.batch * p.context * p.kv_heads * p.head_dim * elem
    q_and_out = 2 * p.batch * p.q_heads * p.head_dim * elem
    table = p.batch * math.ceil(p.context / p.block_size) * 8
    return kv + q_and_out + table


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    """Spec peak from the memory clock (kHz, double data rate) and bus width (bits)."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def copy_bandwidth_gbs(device: torch.device, bench: Callable[..., float]) -> float:
    """A device-to-device copy of 1 GiB: about the best any kernel can do."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def run_point(
    p: Point,
    device: torch.device,
    bench: Callable[..., float],
    peak_gbs: float | None,
    copy_gbs: float | None,
) -> Result:
    b = make_batch(p, device)
    scale = p.head_dim**-0.5
    dtype = b.query.dtype
    triton_plan = plan_paged_attention_triton(
        b.query_start_loc, b.seq_lens, b.block_table, p.block_size, dtype
    )
    torch_plan = plan_paged_attention_torch(
        b.query_start_loc, b.seq_lens, b.block_table, p.block_size, dtype
    )
    q, cache = b.query, b.kv_cache

    def run_triton() -> torch.Tensor:
        return paged_attention_triton(q, q, q, cache, triton_plan, scale)

    def run_torch_backend() -> torch.Tensor:
        return paged_attention_torch(q, q, q, cache, torch_plan, scale)

    reference = gather_then_sdpa(b, scale)
    diff = float((run_triton().float() - reference.float()).abs().max())
    triton_ms = bench(run_triton)
    gbs = decode_bytes(p) / (triton_ms * 1e-3) / 1e9
    return Result(
        point=p,
        triton_us=triton_ms * 1e3,
        gbs=gbs,
        pct_peak=100 * gbs / peak_gbs if peak_gbs else None,
        pct_copy=100 * gbs / copy_gbs if copy_gbs else None,
        sdpa_us=bench(lambda: gather_then_sdpa(b, scale)) * 1e3,
        torch_backend_us=bench(run_torch_backend) * 1e3,
        max_abs_diff=diff,
    )


def _cpu_bench(fn: Callable[[], object], reps: int = 3) -> float:
    import time

    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]  # ms


def render(results: list[Result], device_name: str, peak: float | None) -> str:
    peak_text = f"{peak:,.0f} GB/s" if peak else "unknown"
    lines = [
        f"device: {device_name}; peak memory bandwidth: {peak_text}",
        "",
        "| batch | context | D | H_q/H_kv | block | dtype | triton µs | GB/s | % peak | "
        "% copy | gather+SDPA µs | triton speed-up | torch backend µs | triton speed-up | "
        "max abs diff |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p = r.point
        pct_peak = f"{r.pct_peak:.0f}%" if r.pct_peak is not None else "-"
        pct_copy = f"{r.pct_copy:.0f}%" if r.pct_copy is not None else "-"
        lines.append(
            f"| {p.batch} | {p.context} | {p.head_dim} | {p.q_heads}/{p.kv_heads} | "
            f"{p.block_size} | {p.dtype} | {r.triton_us:,.1f} | {r.gbs:,.0f} | {pct_peak} | "
            f"{pct_copy} | {r.sdpa_us:,.1f} | {r.sdpa_us / r.triton_us:.2f}x | "
            f"{r.torch_backend_us:,.1f} | {r.torch_backend_us / r.triton_us:.2f}x | "
            f"{r.max_abs_diff:.1e} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--peak-gbs", type=float, default=None, help="override the spec peak")
    parser.add_argument("--no-sweep", action="store_true", help="only the main point")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()

    main_point = Point(
        args.batch,
        args.context,
        args.head_dim,
        args.q_heads,
        args.kv_heads,
        args.block_size,
        args.dtype,
    )
    if not HAS_CUDA:
        print(
            "No CUDA device: nothing to measure. Running one tiny point under Triton's "
            "interpreter to check that the benchmark runs and the kernel agrees with the "
            "reference; its timings are the interpreter's, not a GPU's."
        )
        smoke = Point(2, 64, 32, 4, 2, 16, "float32")
        result = run_point(smoke, torch.device("cpu"), _cpu_bench, None, None)
        print(render([result], "cpu (Triton interpreter)", None))
        ok = result.max_abs_diff < 1e-4
        print("smoke check:", "ok" if ok else f"FAILED (max |diff| {result.max_abs_diff:.1e})")
        return 0 if ok else 1

    import triton.testing

    device = torch.device("cuda")

    def bench(fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    peak = args.peak_gbs or peak_bandwidth_gbs(device)
    copy_gbs = copy_bandwidth_gbs(device, bench)
    print(f"device-to-device copy: {copy_gbs:,.0f} GB/s")
    points = [main_point]
    if not args.no_sweep:
        # Long decodes at small batches: too few (sequence, KV head) programs, so split-K.
        points += [
            dataclasses.replace(main_point, batch=8, context=8192),
            dataclasses.replace(main_point, batch=1, context=32768),
        ]
    results = [run_point(p, device, bench, peak, copy_gbs) for p in points]
    print(render(results, torch.cuda.get_device_name(device), peak))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
