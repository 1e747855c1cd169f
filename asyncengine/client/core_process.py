"""CoreProcess: one engine core in a process of its own, from spawn to shutdown.

`python -m asyncengine.core.engine_core_proc` (a fresh interpreter: no entry-point guard
needed) gets its config on stdin and says HELLO on a handshake socket bound here; it is told
where to bind its input socket and where its clients' output sockets are; it answers READY
(model loaded, KV cache allocated) or FAILED with the root cause. The caller owns the
request and output sockets (ProcCoreClient for one core, DPCoreClient for several).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path

import anyio
import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError
from asyncengine.ipc.messages import (
    EngineCoreLaunch,
    HandshakeAddresses,
    HandshakeFailed,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
)
from asyncengine.ipc.serial import MsgpackEncoder, handshake_decoder
from asyncengine.ipc.sockets import ipc_address, make_socket

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0  # terminate → join this long → kill


class CoreProcess:
    """One engine core's process and its start-up handshake.

    `launch()` spawns it (returns at once); `wait_ready()` answers its HELLO with the
    addresses and waits for READY (EngineStartupError with the root cause otherwise);
    `wait_exit()` returns when the process has exited; `stop()` ends it (and every process
    it started) and is idempotent. `name` ("engine core", "engine core rank 1") is how
    messages speak of it. The core ignores SIGINT (`ignore_sigint`): a terminal's Ctrl-C
    reaches the whole process group, and the core's owner acts on it, stopping the core
    when it is done with it (after a drain, when serving).
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
        tcp_host: str | None = None,
    ) -> None:
        self.config = config
        self.ignore_sigint = ignore_sigint
        self.name = name
        self.startup_timeout = startup_timeout
        rank = config.parallel_config.data_parallel_rank
        if tcp_host is None:
            self.input_address = ipc_address(socket_dir, f"input-{rank}")
            handshake_address = ipc_address(socket_dir, f"handshake-{rank}")
        else:  # a core on another machine: a free port of this host's, and of the core's
            self.input_address = "tcp://127.0.0.1:*"  # set to the core's node by its launcher
            handshake_address = f"tcp://{tcp_host}:*"
        self._handshake = make_socket(ctx, handshake_address, zmq.ROUTER, bind=True)
        self._handshake_address = self._handshake.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = MsgpackEncoder()
        self._deadline = 0.0
        self.proc: ChildProcess | None = None
        self.num_kv_blocks = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def launch(self) -> None:
        """Start the process (once); it imports the model code while the caller goes on."""
        if self.proc is not None:
            return
        self._deadline = time.monotonic() + self.startup_timeout
        launch = EngineCoreLaunch(self.config, self._handshake_address, self.ignore_sigint)
        proc = ChildProcess(
            "asyncengine.core.engine_core_proc",
            self._encoder.encode(launch),
            name="AsyncEngineCore",
        )
        self.proc = proc
        await anyio.to_thread.run_sync(proc.start)

    async def wait_ready(self, output_addresses: list[str]) -> None:
        """HELLO → the addresses → READY; then the core has bound its input socket."""
        await self.launch()
        identity, hello = await self._recv_handshake()
        if not isinstance(hello, HandshakeHello):
            raise EngineStartupError(f"{self.name} sent {type(hello).__name__} before HELLO")
        addresses = HandshakeAddresses(self.input_address, output_addresses)
        self._handshake.send_multipart([identity, self._encoder.encode(addresses)])
        _, message = await self._recv_handshake()
        if isinstance(message, HandshakeFailed):
            raise EngineStartupError(f"{self.name} failed to start: {message.error}")
        if not isinstance(message, HandshakeReady):
            raise EngineStartupError(f"{self.name} sent {type(message).__name__}, not READY")
        self.num_kv_blocks = message.num_kv_blocks
        self.input_address = message.input_address or self.input_address
        self._handshake.close(linger=0)

    async def _recv_handshake(self) -> tuple[bytes, HandshakeMessage]:
        sock, deadline = self._handshake, self._deadline
        died_at: float | None = None
        while True:
            try:
                identity, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                try:
                    return identity, handshake_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    raise EngineStartupError(f"malformed handshake message: {exc}") from exc
            if readable(sock):
                continue
            now = time.monotonic()
            if not self._alive():
                # A FAILED message sent just before the exit may still be in flight.
                died_at = died_at or now
                if now - died_at > 0.5:
                    raise EngineStartupError(
                        f"{self.name} process exited during start-up ({self.exit_desc()}); "
                        "see its log above for the cause"
                    )
            if now > deadline:
                raise EngineStartupError(
                    f"{self.name} did not become ready within {self.startup_timeout} s"
                )
            with anyio.move_on_after(min(0.1, deadline - now)):
                await anyio.wait_readable(socket_fd(sock))

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    async def wait_exit(self, poll: float = 0.5) -> bool:
        """Wait up to `poll` seconds for the process to exit; True once it has."""
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
        """Stop the process and every process it started (shielded, idempotent); `kill`: at
        once, for a process that would never act on SIGTERM (stopped, or hung)."""
        with anyio.CancelScope(shield=True):
            self._handshake.close(linger=0)
            proc = self.proc
            if proc is not None and proc.pid is not None and proc.sentinel >= 0:
                await anyio.to_thread.run_sync(stop_process_tree, proc, kill)


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's edge-triggered notification FD (readable when its events may have changed)."""
    return int(sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket[bytes]) -> bool:
    # Reading EVENTS also re-arms the FD's edge: check it before waiting again.
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


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


class RunningCore:
    """An engine core that another process started and owns (the API server manager), as
    its clients see it: where to send requests, its pid to watch; it is never stopped here."""

    def __init__(self, name: str, input_address: str, pid: int, num_kv_blocks: int) -> None:
        self.name = name
        self.input_address = input_address
        self.pid: int | None = pid
        self.num_kv_blocks = num_kv_blocks

    async def launch(self) -> None:
        return None

    async def wait_ready(self, output_addresses: list[str]) -> None:
        return None  # its owner saw it ready, with this client's output address among its own

    async def wait_exit(self, poll: float = 0.5) -> bool:
        """Poll the pid (not our child: no sentinel); a zombie awaits its owner's reaping."""
        import psutil

        with anyio.move_on_after(poll):
            while True:
                try:
                    if psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE:
                        return True
                except psutil.NoSuchProcess:
                    return True
                await anyio.sleep(0.1)
        return False

    def exit_desc(self) -> str:
        return "exited"

    async def stop(self, kill: bool = False) -> None:
        return None  # its owner stops it


async def start_cores(cores: list[CoreProcess], output_addresses: list[str]) -> None:
    """Start every core at once and wait until all serve; the first that fails raises its
    EngineStartupError (naming it, with the root cause) and the others are cancelled
    (the caller stops them)."""
    failures: list[BaseException] = []

    async def start_one(core: CoreProcess, scope: anyio.CancelScope) -> None:
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
