"""Handing freed heap back to the system (glibc), for processes that live long.

glibc keeps memory freed below its mmap threshold in its arenas: resident, unused. That
threshold rises to the largest block freed so far (up to 32 MiB), so after a model load or a
burst of large steps most of a step's buffers come from the arenas and stay there. Trimming
returns those pages; the next allocation that needs them takes page faults instead, so the
callers trim at quiet moments only (after each loaded layer, when the engine has been idle).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from typing import Any

# How long a process that runs steps (the engine core, a tensor-parallel worker) waits idle
# after its last step before it releases the heap: requests that arrive back to back never pay
# for the trim, nor for the page faults of re-growing what it released.
IDLE_RELEASE_S = 2.0

# Large weight copies made at load (the interleaved quantized weights) are asked for transparent
# huge pages, which Linux gives on request in its common default mode ("madvise"): a decode step
# streams every weight once, and 2 MiB pages take the TLB misses of 4 KiB ones out of that
# stream (Zen 4, 2 threads, a 1B model's 215 MB Q6_K lm_head read from memory: 3-4% faster in
# 26 of 30 alternating calls). ASYNCENGINE_HUGE_PAGES=0 turns it off.
HUGE_PAGE = 2 << 20


@functools.cache
def libc_function(name: str) -> Any:
    """A glibc function by name, or None (not glibc, or not found); looked up once."""
    libc = ctypes.util.find_library("c")
    if libc is None:
        return None
    try:
        return getattr(ctypes.CDLL(libc), name)
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the free pages of malloc's arenas to the system (`malloc_trim`); a no-op
    outside glibc. Takes 1-6 ms after a 0.5B model's steps here."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def huge_page_buffer(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """Fresh anonymous memory for `nbytes` (a mapping, and the offset in it where they start,
    2 MiB-aligned), asked for huge pages; None where that does not apply (under 4 MiB, not
    Linux, turned off): then allocate as usual. The pages are taken when first written; the
    alignment's slack is never touched, so never resident."""
    if (
        nbytes < 2 * HUGE_PAGE
        or sys.platform != "linux"
        or os.environ.get("ASYNCENGINE_HUGE_PAGES", "1") == "0"
    ):
        return None
    # private: a shared anonymous mapping is shmem, whose huge pages are another setting
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError, ValueError):  # else 4 KiB pages
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return buffer, offset
