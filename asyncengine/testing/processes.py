"""Process checks for tests: what this process has spawned, and that it is gone."""

from __future__ import annotations

import contextlib
import os

import psutil


def child_pids() -> set[int]:
    """This process's descendants, less multiprocessing's own resource tracker (a helper that
    the spawn start method starts once per interpreter and keeps)."""
    pids = set()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.Error:
            pass
    return pids


def assert_gone(pids: set[int], timeout: float = 5.0) -> None:
    """Wait up to `timeout` seconds for every process in `pids` to exit; fail if one remains."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout)
    assert not alive, f"processes left behind: {alive}"
