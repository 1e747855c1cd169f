# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Paged attention over a packed varlen batch, Triton.

Same contract as the torch reference in `paged_attention.py`: sequence i contributes the last
`q_len_i = query_start_loc[i+1] - query_start_loc[i]` of its `seq_lens[i]` tokens as queries,
attends causally over all its tokens in the paged cache (`[2, H_kv, num_blocks, block_size, D]`)
through `block_table`, with GQA/MQA (each KV head serves `H_q / H_kv` query heads).

`plan_paged_attention_triton` runs once per step: it sorts the sequences into decodes (one query
token) and prefill chunks (more than one, with or without an already-cached prefix) and copies
the batch layout to the device in one transfer. `paged_attention_triton` then runs per layer
with no host synchronisation: two launches (decode, prefill tiles), plus a reduction when long
decodes are split.

Kernels (each program handles one KV head, so the K/V it streams serve all of that head's
query heads, which are rows of the same `tl.dot`):
- `_decode_kernel`: grid (decodes, H_kv, splits). Split s covers a range of key positions; with
  one split it writes the output, otherwise (flash-decoding) it writes an unnormalised partial
  output with its running max and sum, and `_reduce_splits_kernel` combines the splits.
- `_prefill_kernel`: grid (query tiles, H_kv, query-head groups). A tile is BLOCK_Q query tokens
  of one sequence times BLOCK_G query heads; it walks keys up to its last query's position.

Both walk keys BLOCK_N at a time, gathering each key's cache row through its block id, so
BLOCK_N is independent of the cache's block size. Softmax runs online in fp32 (base 2, with
the scale folded into log2(e)); the dots accumulate in fp32. Under the interpreter the kernels
upcast every load to fp32, because its half-precision arithmetic is not faithful.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton_utils import (
    LAUNCH_OPTIONS,
    cast_rne,
    check_device,
    is_interpreted,
    next_power_of_2,
    tl_max,
    tl_sum,
)

PREFILL_BLOCK_Q = 16  # query tokens per prefill tile
# Tile sizes in bytes of one K (or V, or query) tile, so that wide heads and fp32 still fit the
# ~99 KiB of shared memory of the smallest current GPUs with pipelined loads.
_KV_TILE_BYTES = 16 * 1024  # BLOCK_N keys x D
_Q_TILE_BYTES = 32 * 1024  # prefill rows (BLOCK_Q x BLOCK_G) x D, at most 128 rows
_DOT_MIN = 16  # tl.dot needs at least 16 rows
_MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to reduce than it saves
_MAX_SPLITS = 64


@dataclass(slots=True)
class TritonAttentionPlan:
    """One step's batch layout on the device, shared by every layer."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32 or int64
    decode_seqs: torch.Tensor  # [Bd] int32: sequences with one query token
    prefill_tiles: torch.Tensor  # [num_tiles, 2] int32: (sequence, first query of the tile)
    max_decode_seq_len: int
    num_splits: int | None = None  # force the decode split count (tests); None: choose


def plan_paged_attention_triton(
    query_start_loc: list[int],  # B + 1 offsets into the packed tokens
    seq_lens: list[int],  # [B] context length including this step's tokens
    block_table: torch.Tensor,  # [B, max_blocks] int32 or int64
    block_size: int,
    dtype: torch.dtype,
) -> TritonAttentionPlan:
    """Plan one step (host lists in, device tensors out); same signature as the torch plan."""
    del block_size, dtype  # read from the cache and the query at launch
    num_seqs = len(seq_lens)
    decode_seqs: list[int] = []
    tiles: list[int] = []  # flattened (sequence, first query) pairs
    max_decode_seq_len = 0
    for i in range(num_seqs):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        if q_len == 1:
            decode_seqs.append(i)
            max_decode_seq_len = max(max_decode_seq_len, seq_lens[i])
        else:
            for q0 in range(0, q_len, PREFILL_BLOCK_Q):
                tiles += (i, q0)
    # One host-to-device copy for the whole layout; the plan's tensors are views of it.
    flat = torch.tensor([*query_start_loc, *seq_lens, *decode_seqs, *tiles], dtype=torch.int32)
    if block_table.device.type == "cuda":
        # From pinned memory, without waiting (a pageable copy waits for the stream to drain).
        flat = flat.pin_memory().to(block_table.device, non_blocking=True)
    else:
        flat = flat.to(block_table.device)
    sizes = [num_seqs + 1, num_seqs, len(decode_seqs), len(tiles)]
    qsl, lens, decodes, tile_flat = torch.split(flat, sizes)
    return TritonAttentionPlan(
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=block_table,
        decode_seqs=decodes,
        prefill_tiles=tile_flat.view(-1, 2),
        max_decode_seq_len=max_decode_seq_len,
    )


@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel for any count
def _decode_kernel(
    out_ptr,  # [T, H_q, D]
    part_acc_ptr,  # [Bd, H_q, num_splits, D] fp32, unnormalised (SPLIT only)
    part_max_ptr,  # [Bd, H_q, num_splits] fp32, running max in log2 units
    part_sum_ptr,  # [Bd, H_q, num_splits] fp32
    query_ptr,  # [T, H_q, D]
    cache_ptr,  # [2, H_kv, num_blocks, block_size, D]
    block_table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    decode_seqs_ptr,  # [Bd]
    scale_log2,  # softmax scale * log2(e)
    num_q_heads,
    group,  # query heads per KV head
    head_dim,
    block_size,
    tokens_per_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_h,
    stride_c_blk,
    stride_c_off,
    stride_bt,
    num_splits,  # a run-time value: every split count shares one compiled kernel
    SPLIT: tl.constexpr,  # num_splits > 1: write partial outputs for the reduction
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + idx)
    seq_len = tl.load(seq_lens_ptr + seq)
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    g = tl.arange(0, BLOCK_G)  # [G] query heads of this KV head (padded for tl.dot)
    d = tl.arange(0, BLOCK_D)  # [D]
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(
        query_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)  # running sum of exp2
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_base = cache_ptr + kv_head * stride_c_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        n_mask = n < end
        block = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_c_blk + (n % block_size) * stride_c_off  # [N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(head_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(head_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl_max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])  # [G, N]
        alpha = tl.exp2(m_i - m_new)  # 0 on the first step (m_i = -inf)
        l_i = l_i * alpha + tl_sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(
            out_ptrs,
            cast_rne(out, out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # An empty split (a sequence shorter than the longest) leaves max -inf and sum 0.
        ml = (idx.to(tl.int64) * num_q_heads + heads) * num_splits + split  # [G]
        tl.store(part_max_ptr + ml, m_i, mask=g_mask)
        tl.store(part_sum_ptr + ml, l_i, mask=g_mask)
        acc_ptrs = part_acc_ptr + ml[:, None] * BLOCK_D + d[None, :]
        tl.store(acc_ptrs, acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [T, H_q, D]
    part_acc_ptr,  # [Bd, H_q, num_splits, BLOCK_D] fp32
    part_max_ptr,  # [Bd, H_q, num_splits] fp32
    part_sum_ptr,  # [Bd, H_q, num_splits] fp32
    query_start_loc_ptr,  # [B + 1]
    decode_seqs_ptr,  # [Bd]
    num_q_heads,
    head_dim,
    stride_ot,
    stride_oh,
    num_splits,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    idx = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seqs_ptr + idx)
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    s = tl.arange(0, BLOCK_S)  # [S]
    d = tl.arange(0, BLOCK_D)  # [D]
    s_mask = s < num_splits
    base = (idx.to(tl.int64) * num_q_heads + head) * num_splits
    m = tl.load(part_max_ptr + base + s, mask=s_mask, other=float("-inf"))  # [S]
    l_s = tl.load(part_sum_ptr + base + s, mask=s_mask, other=0.0)
    m_max = tl_max(m, axis=0)  # finite: split 0 always holds a key
    w = tl.exp2(m - m_max)  # [S]; 0 for empty splits
    acc = tl.load(
        part_acc_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0
    )  # [S, D]
    out = tl_sum(acc * w[:, None], axis=0) / tl_sum(l_s * w, axis=0)  # [D]
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + d,
        cast_rne(out, out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, H_q, D]
    query_ptr,  # [T, H_q, D]
    cache_ptr,  # [2, H_kv, num_blocks, block_size, D]
    block_table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    tiles_ptr,  # [num_tiles, 2]: (sequence, first query of the tile)
    scale_log2,
    group,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_h,
    stride_c_blk,
    stride_c_off,
    stride_bt,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    g0 = tl.program_id(2) * BLOCK_G
    seq = tl.load(tiles_ptr + 2 * tile)
    q0 = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # the cached prefix

    # Row r of the tile is query token q0 + r // BLOCK_G, query head g0 + r % BLOCK_G.
    r = tl.arange(0, BLOCK_Q * BLOCK_G)  # [M]
    qi = q0 + r // BLOCK_G
    g = g0 + r % BLOCK_G
    d = tl.arange(0, BLOCK_D)  # [D]
    row_mask = (qi < q_len) & (g < group)
    d_mask = d < head_dim
    tok = (q_start + qi).to(tl.int64)
    heads = kv_head * group + g
    q = tl.load(
        query_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_len + qi  # [M] each query's position in its sequence

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_base = cache_ptr + kv_head * stride_c_h
    kv_end = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)  # past the tile's last query
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [N]
        n_mask = n < kv_end
        block = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_c_blk + (n % block_size) * stride_c_off  # [N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(head_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(head_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        # Causal: every row sees key 0 (padding rows see all keys), so no row is all -inf.
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl_max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl_sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(
        out_ptrs, cast_rne(out, out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :]
    )


def paged_attention_triton(
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D] unused: this step's K/V are read from the cache
    value: torch.Tensor,  # [T, H_kv, D] unused
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], already holding this step
    plan: TritonAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H_q, D]
    """Attention for every packed query token (Triton); same signature as the torch reference.

    `reshape_and_cache` must have written this step's K/V first. Inputs may be fp16, bf16 or
    fp32 (query and cache of the same dtype); the output has the query's dtype.
    """
    del key, value
    check_device(_decode_kernel, query)
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head dimension must be contiguous"
    output = torch.empty_like(query)
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    interpreted = is_interpreted(_decode_kernel)
    block_d = next_power_of_2(head_dim)
    row_bytes = block_d * query.element_size()
    common = _Launch(
        group=num_q_heads // num_kv_heads,
        block_d=block_d,
        block_n=max(_DOT_MIN, min(64, _KV_TILE_BYTES // row_bytes)),
        row_bytes=row_bytes,
        scale_log2=scale * math.log2(math.e),
        upcast=interpreted,
        # fp32 inputs are attended in full fp32, not rounded to TF32 by the tensor cores.
        dot_precision="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if plan.decode_seqs.numel():
        _launch_decode(query, kv_cache, plan, output, common, interpreted)
    if plan.prefill_tiles.numel():
        _launch_prefill(query, kv_cache, plan, output, common)
    return output


def warm_up_decode(kv_cache: torch.Tensor, num_q_heads: int) -> None:
    """Compile, before any request, the decode kernels a step may choose: unsplit, and the
    split reduction for each power-of-two block of split counts (its only compile-time
    parameter besides the model's shapes). One query token over slot 0 of `kv_cache`, which
    is only read."""
    device, head_dim = kv_cache.device, kv_cache.shape[-1]
    query = torch.zeros((1, num_q_heads, head_dim), dtype=kv_cache.dtype, device=device)
    block_table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    plan = plan_paged_attention_triton([0, 1], [1], block_table, kv_cache.shape[3], query.dtype)
    # Long enough for every split count to survive rounding to whole key blocks; the kernels
    # read the real length (1) from the plan's tensors.
    plan.max_decode_seq_len = _MAX_SPLITS * 64
    splits = 1
    while splits <= _MAX_SPLITS:
        plan.num_splits = splits
        paged_attention_triton(query, query, query, kv_cache, plan, head_dim**-0.5)
        splits *= 2


@dataclass(frozen=True, slots=True)
class _Launch:
    group: int
    block_d: int
    block_n: int
    row_bytes: int  # one head row of the query/cache dtype, padded to block_d
    scale_log2: float
    upcast: bool
    dot_precision: str


def _launch_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    output: torch.Tensor,
    c: _Launch,
    interpreted: bool,
) -> None:
    num_decodes = plan.decode_seqs.numel()
    num_q_heads, num_kv_heads = query.shape[1], kv_cache.shape[1]
    splits = plan.num_splits
    if splits is None:
        splits = 1 if interpreted else _choose_num_splits(num_decodes * num_kv_heads, plan, query)
    # Whole BLOCK_N steps per split; drop splits that would start past the longest sequence.
    per_split = triton.cdiv(plan.max_decode_seq_len, splits)
    tokens_per_split = triton.cdiv(per_split, c.block_n) * c.block_n
    splits = triton.cdiv(plan.max_decode_seq_len, tokens_per_split)
    if splits > 1:
        part_acc = torch.empty(
            (num_decodes, num_q_heads, splits, c.block_d), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_decodes, num_q_heads, splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel
        part_acc = part_max = part_sum = output
    _decode_kernel[(num_decodes, num_kv_heads, splits)](
        output,
        part_acc,
        part_max,
        part_sum,
        query,
        kv_cache,
        plan.block_table,
        plan.seq_lens,
        plan.query_start_loc,
        plan.decode_seqs,
        c.scale_log2,
        num_q_heads,
        c.group,
        query.shape[2],
        kv_cache.shape[3],
        tokens_per_split,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        plan.block_table.stride(0),
        splits,
        SPLIT=splits > 1,
        BLOCK_G=max(_DOT_MIN, next_power_of_2(c.group)),
        BLOCK_D=c.block_d,
        BLOCK_N=c.block_n,
        UPCAST=c.upcast,
        DOT_PRECISION=c.dot_precision,
        num_warps=4,
        num_stages=3,
        **LAUNCH_OPTIONS,
    )
    if splits > 1:
        _reduce_splits_kernel[(num_decodes, num_q_heads)](
            output,
            part_acc,
            part_max,
            part_sum,
            plan.query_start_loc,
            plan.decode_seqs,
            num_q_heads,
            query.shape[2],
            output.stride(0),
            output.stride(1),
            splits,
            BLOCK_S=next_power_of_2(splits),
            BLOCK_D=c.block_d,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )


def _launch_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    output: torch.Tensor,
    c: _Launch,
) -> None:
    num_kv_heads = kv_cache.shape[1]
    # A tile holds BLOCK_Q tokens times up to BLOCK_G of a KV head's query heads; larger groups
    # take several programs (each re-reads the KV head).
    max_rows = min(128, _Q_TILE_BYTES // c.row_bytes)
    block_g = min(next_power_of_2(c.group), max(1, max_rows // PREFILL_BLOCK_Q))
    grid = (plan.prefill_tiles.shape[0], num_kv_heads, triton.cdiv(c.group, block_g))
    _prefill_kernel[grid](
        output,
        query,
        kv_cache,
        plan.block_table,
        plan.seq_lens,
        plan.query_start_loc,
        plan.prefill_tiles,
        c.scale_log2,
        c.group,
        query.shape[2],
        kv_cache.shape[3],
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        plan.block_table.stride(0),
        BLOCK_Q=PREFILL_BLOCK_Q,
        BLOCK_G=block_g,
        BLOCK_D=c.block_d,
        BLOCK_N=c.block_n,
        UPCAST=c.upcast,
        DOT_PRECISION=c.dot_precision,
        num_warps=8 if PREFILL_BLOCK_Q * block_g * c.row_bytes >= _Q_TILE_BYTES else 4,
        num_stages=2,
        **LAUNCH_OPTIONS,
    )


def _choose_num_splits(programs: int, plan: TritonAttentionPlan, query: torch.Tensor) -> int:
    """Split long decodes until about two programs per SM are in flight (flash-decoding)."""
    target = 2 * _multiprocessor_count(query.device.index or 0)
    if programs >= target:
        return 1
    by_length = max(1, plan.max_decode_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(-(-target // programs), by_length, _MAX_SPLITS))


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(props.multi_processor_count)
