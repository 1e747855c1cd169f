"""Helpers shared by the async client tests."""

from __future__ import annotations

from typing import Any

import anyio

from asyncengine import AsyncLLM
from asyncengine.ipc.messages import EngineStats
from asyncengine.testing.processes import assert_gone, child_pids

__all__ = ["ENGINE_KW", "assert_gone", "child_pids", "wait_until_idle"]

# Small and fast: a few hundred KV blocks, short contexts; on the CPU on any machine.
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=512, seed=0
)


async def wait_until_idle(engine: AsyncLLM, limit_s: float = 10.0) -> EngineStats:
    """Poll the core until no request runs or waits; its stats then."""
    with anyio.fail_after(limit_s):
        while True:
            stats = await engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
                return stats
            await anyio.sleep(0.02)
