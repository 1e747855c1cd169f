"""CoreHandle: one engine core (a data-parallel rank) as its client sees it; CoreBackend:
where the cores run, and who starts them.

Implementations: CoreProcess (a process of this one's, process.py), RayCore (a Ray actor's
child process, ray_core.py), RunningCore (a core another process started and owns: the API
server manager's, attached.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from asyncengine.config import EngineConfig


class CoreHandle(ABC):
    """One engine core, from launch to stop.

    `name` ("engine core", "engine core rank 1") is how messages speak of it. Its
    `input_address` (where requests go) and `num_kv_blocks` are known once it is ready.
    """

    name: str
    input_address: str
    num_kv_blocks: int = 0

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The core process's pid (None before launch; on another machine's, its pid there)."""

    @abstractmethod
    async def launch(self) -> None:
        """Start the core (once) and return at once: it loads the model while the caller
        goes on."""

    @abstractmethod
    async def wait_ready(self, output_addresses: list[str]) -> None:
        """Tell the core where its clients' output sockets are and wait until it serves
        (its input socket bound); EngineStartupError with the root cause otherwise."""

    @abstractmethod
    async def wait_exit(self, poll: float = 0.5) -> bool:
        """Wait up to `poll` seconds for the core to exit; True once it has."""

    @abstractmethod
    def exit_desc(self) -> str:
        """How the core ended, for messages ("exit code 1", "killed by SIGKILL")."""

    @abstractmethod
    async def stop(self, kill: bool = False) -> None:
        """Stop the core and every process it started (shielded, idempotent); `kill`: at
        once, for a core that would never act on SIGTERM (stopped, or hung)."""


class CoreBackend(ABC):
    """Where a client's engine cores run, and who starts them (see launch_cores)."""

    async def open(self, startup_timeout: float) -> None:
        """Get ready to make cores (connect to a cluster); a no-op by default."""
        return None

    @abstractmethod
    def output_address(self) -> str:
        """Where the cores send this client's outputs (the client binds it; a `*` port is
        picked then). Known once `open()` has returned."""

    @abstractmethod
    def make_core(self, config: EngineConfig, name: str, startup_timeout: float) -> CoreHandle:
        """The handle of the core of `config` (one rank's), not launched yet."""

    async def close(self) -> None:
        """Release what `open()` took (after every core has stopped); a no-op by default."""
        return None
