"""RunningCore: an engine core that another process started and owns, as its clients see it.

The API server manager starts the cores and hands each API server process their addresses
and pids; each server is then one client of them all (AttachedCores, its backend).
"""

from __future__ import annotations

import anyio

from asyncengine.client.cores.handle import CoreBackend, CoreHandle
from asyncengine.config import EngineConfig


class RunningCore(CoreHandle):
    """Where to send requests, its pid to watch; it is never launched or stopped here."""

    def __init__(self, name: str, input_address: str, pid: int, num_kv_blocks: int) -> None:
        self.name = name
        self.input_address = input_address
        self._pid = pid
        self.num_kv_blocks = num_kv_blocks

    @property
    def pid(self) -> int | None:
        return self._pid

    async def launch(self) -> None:
        return None  # its owner started it

    async def wait_ready(self, output_addresses: list[str]) -> None:
        return None  # its owner saw it ready, with this client's output address among its own

    async def wait_exit(self, poll: float = 0.5) -> bool:
        """Poll the pid (not our child: no sentinel); a zombie awaits its owner's reaping."""
        import psutil

        with anyio.move_on_after(poll):
            while True:
                try:
                    if psutil.Process(self._pid).status() == psutil.STATUS_ZOMBIE:
                        return True
                except psutil.NoSuchProcess:
                    return True
                await anyio.sleep(0.1)
        return False

    def exit_desc(self) -> str:
        return "exited"

    async def stop(self, kill: bool = False) -> None:
        return None  # its owner stops it


class AttachedCores(CoreBackend):
    """Cores another process started (one per rank), whose outputs for this client come to
    `output_address` (which the client binds)."""

    def __init__(self, cores: list[RunningCore], output_address: str) -> None:
        self.cores = cores
        self._output_address = output_address

    def output_address(self) -> str:
        return self._output_address

    def make_core(self, config: EngineConfig, name: str, startup_timeout: float) -> CoreHandle:
        rank = config.parallel_config.data_parallel_rank
        if rank >= len(self.cores):
            raise ValueError(f"no running core was given for data-parallel rank {rank}")
        return self.cores[rank]
