"""LoRA's shrink and expand, native (csrc/lora.c's ae_lora_add) against the torch reference
(kernels/lora.py): several adapters' segments in one call, rows of no adapter untouched, ranks
8 to 64, awkward widths, fp32 and bf16 activations and weights, q/k/v-like groups of parts; and
the same on builds for AVX2-only and plain x86-64 CPUs."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest
import torch

from asyncengine.kernels import cpu_native
from asyncengine.kernels.cpu_native import CSRC, NativeKernels, load_native, unavailable_reason
from asyncengine.kernels.lora import (
    LORA_FIELDS,
    LORA_GROUPS,
    lora_add_native,
    lora_add_segments,
    lora_descriptor,
)

pytestmark = [
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
    pytest.mark.timeout(240),
]


def test_descriptor_layout_is_the_headers() -> None:
    header = (CSRC / "ae_kernels.h").read_text()
    fields = re.search(r"enum ae_lora_field \{(.*?)\};", header, re.S)
    groups = re.search(r"enum ae_lora_group \{(.*?)\};", header, re.S)
    assert fields is not None and groups is not None
    assert len([n for n in fields.group(1).split(",") if n.strip()]) == LORA_FIELDS + 1
    names = [n.strip().removeprefix("AE_LORA_").lower() for n in groups.group(1).split(",")]
    assert names[:-1] == [g.removesuffix("_proj") for g in LORA_GROUPS]


def _case(
    lib: NativeKernels,
    dtype: torch.dtype,
    wdtype: torch.dtype,
    ranks: tuple[int, ...],
    tokens: int,
    hidden: int,
    widths: tuple[int, ...],
    seed: int,
) -> None:
    """Adapters of `ranks` on a group of parts of `widths` (stacked side by side in one output,
    as a joint q/k/v product), each adapter on its own scattered rows; native == reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    out = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    order = torch.randperm(tokens, generator=g)
    # each adapter takes a run of the shuffled rows; the last quarter of rows has none
    covered = max(1, tokens * 3 // 4)
    bounds = [covered * i // len(ranks) for i in range(len(ranks) + 1)]
    keep: list[torch.Tensor] = []
    descs, reference = [], out.clone()
    cols = [sum(widths[:p]) for p in range(len(widths))]
    for i, rank in enumerate(ranks):
        rows = order[bounds[i] : bounds[i + 1]]
        # part p gets a rank of its own (the last part none: not adapted, like a skipped k)
        part_ranks = [rank // (p + 1) for p in range(len(widths))]
        if len(widths) > 1:
            part_ranks[-1] = 0
        a = (torch.randn(sum(part_ranks), hidden, generator=g) * 0.3).to(wdtype)
        parts: list[tuple[torch.Tensor, int] | None] = []
        lo = 0
        for p, (r, width) in enumerate(zip(part_ranks, widths, strict=True)):
            if r == 0:
                parts.append(None)
                continue
            bt = (torch.randn(r, width, generator=g) * 0.3).to(wdtype)
            keep.append(bt)
            parts.append((bt, lo))
            view = reference[:, cols[p] : cols[p] + width]
            lora_add_segments(view, x, [(rows, a[lo : lo + r].float(), bt.t().float())])
            lo += r
        keep.append(a)
        descs.append(torch.tensor(lora_descriptor(a, parts), dtype=torch.int64))
    seg_rows = torch.tensor(bounds, dtype=torch.int64)
    got = out.clone()
    lora_add_native(
        lib, got, x, list(zip(cols, widths, strict=True)), order[: bounds[-1]].clone(),
        seg_rows, torch.tensor([d.data_ptr() for d in descs], dtype=torch.int64),
    )  # fmt: skip
    untouched = order[bounds[-1] :]
    assert torch.equal(got[untouched], out[untouched])
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    else:  # another summation order: the rounded delta (then the sum) may differ in a last bit
        ulp = (reference.float().abs() + out.float().abs()) * 2.0**-7 + 1e-6
        assert torch.all((got.float() - reference.float()).abs() <= 2 * ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_segments_match_the_reference(dtype: torch.dtype, wdtype: torch.dtype, rank: int) -> None:
    lib = load_native()
    assert lib is not None
    # three adapters, awkward shapes: input not a multiple of 16, parts of 67, 21, 21 columns
    _case(lib, dtype, wdtype, (rank, rank // 2, rank), 23, 70, (67, 21, 21), seed=rank)
    # one part, one adapter, one row (a one-stream decode step)
    _case(lib, dtype, wdtype, (rank,), 1, 576, (576,), seed=rank + 1)
    # many rows per adapter, wide parts (gate/up-like)
    _case(lib, dtype, wdtype, (rank, rank), 64, 96, (200, 200), seed=rank + 2)
    # a decode-sized call (on the work pool, csrc/pool.c, with threads to share it)
    _case(lib, dtype, wdtype, (rank, rank // 2, rank), 7, 1000, (67, 21, 21), seed=rank + 3)
    # more adapters than a pool job's context holds (the kernel's general path)
    _case(lib, dtype, wdtype, (rank,) * 7, 30, 300, (67, 21, 21), seed=rank + 4)


@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_every_thread_count_gives_the_same_numbers(tokens: int) -> None:
    """One thread, or a team (the work pool for up to 8 rows, OpenMP above): the same sums in
    the same order, so the same bits."""
    lib = load_native()
    assert lib is not None
    threads = torch.get_num_threads()
    results = []
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            g = torch.Generator().manual_seed(tokens)
            out = torch.randn(tokens, 300, generator=g).to(torch.bfloat16)
            x = torch.randn(tokens, 1000, generator=g).to(torch.bfloat16)
            a = torch.randn(20, 1000, generator=g) * 0.3  # parts of rank 12 and 8
            bts = [torch.randn(12, 200, generator=g), torch.randn(8, 100, generator=g)]
            desc = torch.tensor(lora_descriptor(a, [(bts[0], 0), (bts[1], 12)]))
            lora_add_native(
                lib, out, x, [(0, 200), (200, 100)], torch.arange(tokens),
                torch.tensor([0, tokens]), torch.tensor([desc.data_ptr()]),
            )  # fmt: skip
            results.append(out)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_no_segments_and_unadapted_groups_add_nothing() -> None:
    lib = load_native()
    assert lib is not None
    x, out = torch.randn(4, 32), torch.randn(4, 16)
    before = out.clone()
    empty = torch.zeros(LORA_FIELDS, dtype=torch.int64)  # A == 0: the group is not adapted
    rows, seg_rows = torch.arange(4), torch.tensor([0, 4])
    lora_add_native(lib, out, x, [(0, 16)], rows, seg_rows, torch.tensor([empty.data_ptr()]))
    no_segments = torch.tensor([], dtype=torch.int64)
    lora_add_native(lib, out, x, [(0, 16)], rows[:0], torch.tensor([0]), no_segments)
    assert torch.equal(out, before)


def test_a_bad_descriptor_is_refused() -> None:
    lib = load_native()
    assert lib is not None
    x, out = torch.randn(2, 32), torch.randn(2, 16)
    a, bt = torch.randn(4, 32), torch.randn(4, 16)
    desc = torch.tensor(lora_descriptor(a, [(bt, 0)]), dtype=torch.int64)
    desc[5] = 8  # part 0 reads rows 0..8 of a 4-row A
    with pytest.raises(ValueError, match="status -2"):
        lora_add_native(
            lib, out, x, [(0, 16)], torch.arange(2), torch.tensor([0, 2]),
            torch.tensor([desc.data_ptr()]),
        )  # fmt: skip


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march names")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_portable_builds_compute_the_same(
    march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vector loops compile to AVX2 (x86-64-v3: no AVX-512) or scalar code (x86-64).
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_native.MARCH_ENV, march)
    cpu_native.load_native.cache_clear()
    try:
        lib = cpu_native.load_native()
        assert lib is not None
        for dtype in (torch.float32, torch.bfloat16):
            _case(lib, dtype, torch.float32, (16, 8), 19, 70, (67, 21, 21), seed=3)
            _case(lib, dtype, torch.bfloat16, (64,), 1, 96, (200, 200), seed=4)
    finally:
        cpu_native.load_native.cache_clear()
