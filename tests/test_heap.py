"""`asyncengine.heap`: the huge-page buffers the interleaved quantized weights are made in."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import pytest
import torch

from asyncengine.heap import HUGE_PAGE, huge_page_buffer
from asyncengine.kernels import quant_cpu

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux only")
def test_a_large_buffer_starts_on_a_huge_page_and_holds_its_bytes() -> None:
    got = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert got is not None
    buffer, offset = got
    assert (ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + offset) % HUGE_PAGE == 0
    view = torch.frombuffer(buffer, dtype=torch.uint8, count=3 * HUGE_PAGE + 5, offset=offset)
    view.fill_(7)
    assert int(view.sum()) == 7 * view.numel()


def test_small_buffers_and_the_switch_fall_back_to_plain_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert huge_page_buffer(HUGE_PAGE) is None  # under 4 MiB: not worth a mapping
    monkeypatch.setenv("ASYNCENGINE_HUGE_PAGES", "0")
    assert huge_page_buffer(8 * HUGE_PAGE) is None


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux only")
def test_an_interleaved_weight_lies_in_a_huge_page_buffer() -> None:
    if quant_cpu.load_native() is None:
        pytest.skip("no native kernels")
    rows = quant_cpu.quantize_weight(torch.randn(4096, 1024) * 0.02, quant_cpu.Q8_0)
    r8 = quant_cpu.repack_r8(rows, quant_cpu.Q8_0)  # 4.4 MB
    assert r8.data_ptr() % HUGE_PAGE == 0 and r8.is_contiguous()
    assert torch.equal(quant_cpu.unpack_r8(r8, quant_cpu.Q8_0_R8), rows)
    # where the system grants them (THP "always" or "madvise"), the pages are huge
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        start = f"{r8.data_ptr():x}-"
        smaps = Path("/proc/self/smaps").read_text()
        entry = next(e for e in re.split(r"\n(?=[0-9a-f]+-)", smaps) if e.startswith(start))
        assert int(re.search(r"AnonHugePages:\s+(\d+)", entry).group(1)) >= 2048  # type: ignore[union-attr]
