"""launch_cores: one engine core per data-parallel rank; start_cores: wait until all serve.

Both a client (ProcCoreClient) and the API server manager start their cores here, so the
rank loop and the cores' names live in one place.
"""

from __future__ import annotations

import anyio

from asyncengine.client.cores.handle import CoreBackend, CoreHandle
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError


def core_name(rank: int, size: int) -> str:
    """How messages speak of rank `rank`'s core: "engine core", or "engine core rank 1"."""
    return "engine core" if size == 1 else f"engine core rank {rank}"


async def launch_cores(
    config: EngineConfig, backend: CoreBackend, *, startup_timeout: float
) -> list[CoreHandle]:
    """A core per rank (`data_parallel_size` of them), each launched (not yet ready: see
    start_cores). If one fails to launch, or this is cancelled, those launched are stopped."""
    size = config.parallel_config.data_parallel_size
    cores = [
        backend.make_core(config.for_rank(rank), core_name(rank, size), startup_timeout)
        for rank in range(size)
    ]
    try:
        for core in cores:
            await core.launch()
    except BaseException:
        await stop_cores(cores)
        raise
    return cores


async def start_cores(cores: list[CoreHandle], output_addresses: list[str]) -> None:
    """Start every core at once and wait until all serve; the first that fails raises its
    EngineStartupError (naming it, with the root cause) and the others are cancelled
    (the caller stops them)."""
    failures: list[BaseException] = []

    async def start_one(core: CoreHandle, scope: anyio.CancelScope) -> None:
        try:
            await core.wait_ready(output_addresses)
        except Exception as exc:
            failures.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for core in cores:
            tg.start_soon(start_one, core, tg.cancel_scope)
    if failures:
        error = failures[0]
        if isinstance(error, EngineStartupError):
            raise error
        raise EngineStartupError(f"engine core start-up failed: {error}") from error


async def stop_cores(cores: list[CoreHandle]) -> None:
    """Stop every core at once (shielded; each stop is idempotent)."""
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for core in cores:
                tg.start_soon(core.stop)
