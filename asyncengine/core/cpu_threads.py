"""ThreadGovernor: on a CPU, the engine's compute threads follow what other processes leave.

Why (measured on 2 cores, SmolLM2; docs/architecture.md, "CPU threads"):
OpenMP threads that sleep at every barrier (`OMP_WAIT_POLICY=PASSIVE`) pay a wake-up at each of
the ~240 parallel regions of a decode step: one stream ran at 64 tok/s, against 160-174 with
threads that spin a little first (`GOMP_SPINCOUNT`, set by `asyncengine.core`). But threads
that spin stall badly when another process wants the same cores: next to one busy process,
one stream fell to 29-50 tok/s. With one thread fewer than the cores others leave idle, there
is no barrier to spin at and nothing to stall: 114 tok/s next to the busy process.

So every `INTERVAL_S` the governor reads how much CPU the machine's other processes used on
this process's cores (`/proc/stat` less this process's own time) and sets torch's thread count
(which the native kernels follow too) to the cores they leave, at least one; a change needs two
readings in a row, so a passing burst does not flap it. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5
# Other processes' use, in cores, at which a core counts as taken (below it, a core they only
# touch now and then stays ours: a stalled barrier now and then costs less than a lost core).
_TAKEN_AT = 0.6
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ThreadGovernor:
    """Adjusts torch's thread count between steps; `tick()` is cheap (a clock read) except
    every INTERVAL_S, when it reads two small /proc files."""

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._enabled = bool(self._cpus) and os.path.exists("/proc/stat") and max_threads > 1
        self._last = 0.0
        self._last_busy = 0.0  # the machine's busy time on our cores, in seconds
        self._last_own = 0.0  # this process's CPU time
        self._pending: int | None = None
        if self._enabled:
            self._last, self._last_busy, self._last_own = self._sample()

    def tick(self) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if now - self._last < INTERVAL_S:
            return
        _, busy, own = self._sample()
        others = max(0.0, (busy - self._last_busy) - (own - self._last_own)) / (now - self._last)
        self._last, self._last_busy, self._last_own = now, busy, own
        wanted = max(1, min(self.max_threads, len(self._cpus) - int(others + 1 - _TAKEN_AT)))
        if wanted == self.threads:
            self._pending = None
        elif self._pending != wanted:
            self._pending = wanted  # once more before it counts
        else:
            self._set(wanted, others)

    def _set(self, threads: int, others: float) -> None:
        import torch

        logger.info(
            "other processes use %.1f of this engine's %d cores: %d compute thread(s)",
            others,
            len(self._cpus),
            threads,
        )
        torch.set_num_threads(threads)
        self.threads = threads
        self._pending = None

    def _sample(self) -> tuple[float, float, float]:
        """(now, busy seconds of our cores since boot, this process's CPU seconds)."""
        busy_ticks = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if not name[3:].isdigit() or int(name[3:]) not in self._cpus:
                    continue
                values = [int(v) for v in fields]
                # user nice system idle iowait irq softirq steal ...: all but idle and iowait
                busy_ticks += sum(values[:3]) + sum(values[5:8])
        times = os.times()
        return time.monotonic(), busy_ticks / _CLOCK_TICKS, times.user + times.system


@contextlib.contextmanager
def fixed_threads(threads: int | None) -> Iterator[None]:
    """torch's thread count on this thread (which the native kernels follow) at `threads`
    while the block runs, then back to what it was; None: left alone.

    For a user's `num_threads` where the engine runs its model in an application's process
    (`LLM`, an in-process `AsyncLLM`): the engine's steps use that many, and the
    application's own count, which the engine has no business changing, is back between them.
    In the engine's own processes the count is set once at start (a no-op here).
    """
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
