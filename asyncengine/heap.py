"""Handing freed heap back to the system (glibc), for processes that live long.

glibc keeps memory freed below its mmap threshold in its arenas: resident, unused. That
threshold rises to the largest block freed so far (up to 32 MiB), so after a model load or a
burst of large steps most of a step's buffers come from the arenas and stay there. Trimming
returns those pages; the next allocation that needs them takes page faults instead, so the
callers trim at quiet moments only (after each loaded layer, when the engine has been idle).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

# How long a process that runs steps (the engine core, a tensor-parallel worker) waits idle
# after its last step before it releases the heap: requests that arrive back to back never pay
# for the trim, nor for the page faults of re-growing what it released.
IDLE_RELEASE_S = 2.0


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
