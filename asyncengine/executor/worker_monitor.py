"""WorkerMonitor: a thread that waits on the worker processes' sentinels.

When a worker exits while the executor is not shutting down, the monitor logs which one and
its exit code, stops the others, and calls `on_failure` exactly once.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Sequence

from asyncengine.child_process import ChildProcess

logger = logging.getLogger(__name__)


class WorkerMonitor:
    def __init__(self, procs: Sequence[ChildProcess], on_failure: Callable[[str], None]) -> None:
        self._procs = list(procs)
        self._on_failure = on_failure
        # Writing to this pipe wakes the thread for a shutdown.
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="WorkerMonitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Expected exits from now on are not failures; joins the thread. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        sentinels = {proc.sentinel: proc for proc in self._procs}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._stopping.is_set():
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        for proc in dead:
            proc.join(timeout=1.0)
        reason = "; ".join(f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}" for p in dead)
        logger.error("worker failure: %s; stopping the other workers", reason)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._on_failure(reason)
