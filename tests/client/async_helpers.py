"""Helpers shared by the async client tests."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import anyio
import psutil

from asyncengine import AsyncLLM
from asyncengine.ipc.messages import EngineStats

# Small and fast: a few hundred KV blocks, short contexts.
ENGINE_KW: dict[str, Any] = dict(dtype="float32", max_model_len=256, num_kv_blocks=512, seed=0)


async def wait_until_idle(engine: AsyncLLM, limit_s: float = 10.0) -> EngineStats:
    """Poll the core until no request runs or waits; its stats then."""
    with anyio.fail_after(limit_s):
        while True:
            stats = await engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
                return stats
            await anyio.sleep(0.02)


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
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout)
    assert not alive, f"processes left behind: {alive}"
