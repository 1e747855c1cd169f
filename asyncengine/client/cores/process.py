"""CoreProcess: one engine core in a process of its own, from spawn to shutdown.

`python -m asyncengine.core.engine_core_proc` (a fresh interpreter: no entry-point guard
needed) gets its config on stdin, then goes through the Handshake (handshake.py). The caller
owns the request and output sockets (ProcCoreClient, or the API server manager's servers).
ProcessBackend makes one per rank, in the caller's private socket directory.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path

import anyio
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.client.cores.handle import CoreBackend, CoreHandle
from asyncengine.client.cores.handshake import Handshake, HandshakeCore
from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import EngineCoreLaunch
from asyncengine.ipc.serial import MsgpackEncoder
from asyncengine.ipc.sockets import ipc_address

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0  # terminate → join this long → kill


class CoreProcess(HandshakeCore):
    """One engine core's process (a child of this one) and its start-up handshake.

    The core ignores SIGINT (`ignore_sigint`): a terminal's Ctrl-C reaches the whole process
    group, and the core's owner acts on it, stopping the core when it is done with it (after
    a drain, when serving).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: EngineConfig,
        socket_dir: Path,
        *,
        name: str = "engine core",
        startup_timeout: float,
        ignore_sigint: bool = True,
    ) -> None:
        self.config = config
        self.ignore_sigint = ignore_sigint
        self.name = name
        rank = config.parallel_config.data_parallel_rank
        self.input_address = ipc_address(socket_dir, f"input-{rank}")
        self._handshake = Handshake(
            ctx,
            ipc_address(socket_dir, f"handshake-{rank}"),
            name=name,
            startup_timeout=startup_timeout,
            alive=self._alive,
            exit_desc=self.exit_desc,
        )
        self.proc: ChildProcess | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def launch(self) -> None:
        if self.proc is not None:
            return
        self._handshake.start_clock()
        launch = EngineCoreLaunch(self.config, self._handshake.address, self.ignore_sigint)
        proc = ChildProcess(
            "asyncengine.core.engine_core_proc",
            MsgpackEncoder().encode(launch),
            name="AsyncEngineCore",
        )
        self.proc = proc
        await anyio.to_thread.run_sync(proc.start)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    async def wait_exit(self, poll: float = 0.5) -> bool:
        proc = self.proc
        assert proc is not None
        with anyio.move_on_after(poll):
            await anyio.wait_readable(proc.sentinel)
            # The sentinel closes as the process exits, a moment before it can be reaped.
            await anyio.to_thread.run_sync(proc.join, 1.0)
            return True
        return False

    def exit_desc(self) -> str:
        assert self.proc is not None
        return exit_desc(self.proc)

    async def stop(self, kill: bool = False) -> None:
        with anyio.CancelScope(shield=True):
            self._handshake.close()
            proc = self.proc
            if proc is not None and proc.pid is not None and proc.sentinel >= 0:
                await anyio.to_thread.run_sync(stop_process_tree, proc, kill)


class ProcessBackend(CoreBackend):
    """Cores as processes of this one, their sockets in `socket_dir` (the mp backend)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], socket_dir: Path) -> None:
        self._ctx = ctx
        self._socket_dir = socket_dir

    def output_address(self) -> str:
        return ipc_address(self._socket_dir, "output")

    def make_core(self, config: EngineConfig, name: str, startup_timeout: float) -> CoreHandle:
        return CoreProcess(
            self._ctx, config, self._socket_dir, name=name, startup_timeout=startup_timeout
        )


def stop_process_tree(proc: ChildProcess, kill: bool = False) -> None:
    """terminate → join (5 s) → kill, for a process and every process it started; with
    `kill`, kill at once (a stopped or hung process would never act on SIGTERM)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if kill:
        proc.kill()
    if proc.is_alive():
        proc.terminate()
        proc.join(SHUTDOWN_JOIN_S)
    if proc.is_alive():
        logger.warning("engine core did not stop within %.0f s: killing it", SHUTDOWN_JOIN_S)
        proc.kill()
        proc.join(SHUTDOWN_JOIN_S)
    for child in children:
        with contextlib.suppress(psutil.Error):  # already gone
            child.kill()
    psutil.wait_procs(children, timeout=SHUTDOWN_JOIN_S)
    proc.join(timeout=0)
    proc.close()


def exit_desc(proc: ChildProcess) -> str:
    """How `proc` ended, for messages: "exit code 1", "killed by SIGKILL"."""
    code = proc.exitcode
    if code is None:
        return "still running"
    if code == 0:
        # The engine's processes exit 0 only when told to stop (SIGTERM), and the stops their
        # owner makes are never reported: another process sent it.
        return "exit code 0: another process stopped it with SIGTERM"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
