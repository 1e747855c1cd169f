"""APIServerProcessManager: `asyncengine serve --api-server-count K`.

The parent process of K API server processes and N engine cores (data-parallel ranks):

1. bind the listening socket (host:port) once, so the port is known good before anything
   loads, and every API server accepts on the same socket (the kernel spreads connections);
2. start the N cores, each with K output addresses (one per API server: every output goes
   back to the API server that sent its request);
3. start the K API servers (`entrypoints/openai/api_server_proc.py`), each an AsyncLLM
   client of all N cores, handing each the listening socket;
4. watch: an API server that dies stops the whole group, and the manager exits non-zero; so
   does the death of every core (a single dead rank is served around by the API servers);
5. on SIGTERM / SIGINT (at any time, start-up included): SIGTERM to every API server (each
   drains, up to its shutdown timeout), then stop the cores; exit 0. A second signal sends
   the API servers a second SIGTERM: they abort what is in flight and exit at once.

The API servers and the cores ignore SIGINT: a terminal's Ctrl-C reaches the whole process
group, and only the manager acts on it, stopping them in order.

The manager's own death stops everything too: its children watch their stdin.
"""

from __future__ import annotations

import logging
import signal
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.client.cores.handle import CoreHandle
from asyncengine.client.cores.launch import launch_cores, start_cores
from asyncengine.client.cores.process import ProcessBackend, exit_desc, stop_process_tree
from asyncengine.config import EngineConfig
from asyncengine.entrypoints.openai.api_server_proc import (
    APIServerLaunch,
    CoreEndpoint,
    ServerOptions,
)
from asyncengine.ipc.sockets import (
    ipc_address,
    make_private_socket_dir,
    remove_socket_dir,
    sweep_stale_socket_dirs,
)

logger = logging.getLogger(__name__)

_LISTEN_BACKLOG = 2048
_STOP_GRACE_S = 5.0  # past its drain, how long an API server is given before it is killed


class APIServerProcessManager:
    """Starts, watches and stops the API server processes and the engine cores they share."""

    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions,
        *,
        api_server_count: int,
        startup_timeout: float = 300.0,
    ) -> None:
        if not isinstance(api_server_count, int) or api_server_count < 1:
            raise ValueError(f"api_server_count={api_server_count!r}: must be an integer >= 1")
        self.config = config
        self.options = options
        self.count = api_server_count
        # Each API server admits its share of the server's limits (max_queued_requests): built
        # here, so that a bound too small to share fails before anything starts.
        self.server_configs = [
            config.for_api_server(index, api_server_count) for index in range(api_server_count)
        ]
        self.startup_timeout = startup_timeout
        self.cores: list[CoreHandle] = []
        self.servers: list[ChildProcess] = []
        self._stopping = False
        self._listener: socket.socket | None = None

    def run(self) -> int:
        """Serve until a signal (exit status 0) or a death in the group (non-zero)."""
        return anyio.run(self._run)

    async def _run(self) -> int:
        self._listener = listener = _listen(self.options.host, self.options.port)
        socket_dir = make_private_socket_dir()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        status = 0
        failure: Exception | None = None
        try:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with anyio.create_task_group() as tg:
                    serving = anyio.CancelScope()
                    tg.start_soon(self._on_signals, signals, serving)
                    try:
                        with serving:
                            status = await self._serve(listener, socket_dir, ctx)
                    except Exception as exc:  # a failed start: raised as itself, below
                        failure = exc
                    await self._stop_all()  # while a second signal can still hurry it
                    tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
            return status
        finally:
            await self._stop_all()  # after a failure: the same order
            listener.close()
            ctx.term()
            remove_socket_dir(socket_dir)
            sweep_stale_socket_dirs()

    async def _on_signals(self, signals: AsyncIterator[int], serving: anyio.CancelScope) -> None:
        """The first signal ends the serving (or the start-up): the API servers drain. The
        second makes them abort what is left, at once."""
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                again = "Ctrl-C" if signum == signal.SIGINT else name
                if self.servers:
                    logger.info(
                        "%s: draining the API servers, for up to %g s (%s again stops at once)",
                        name,
                        self.options.shutdown_timeout,
                        again,
                    )
                else:
                    logger.info("%s during start-up: stopping", name)
                serving.cancel()
            else:
                logger.info("%s again: the API servers abort what is in flight", name)
                for server in self.servers:
                    server.terminate()  # their second SIGTERM

    async def _serve(
        self, listener: socket.socket, socket_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
    ) -> int:
        """Start the cores and the API servers, then watch them (see _watch)."""
        outputs = [ipc_address(socket_dir, f"api-output-{i}") for i in range(self.count)]
        self.cores = await launch_cores(
            self.config, ProcessBackend(ctx, socket_dir), startup_timeout=self.startup_timeout
        )
        await start_cores(self.cores, outputs)
        endpoints = []
        for core in self.cores:
            assert core.pid is not None
            endpoints.append(CoreEndpoint(core.input_address, core.pid, core.num_kv_blocks))
        metrics_dir = tempfile.mkdtemp(prefix="metrics-", dir=socket_dir)
        for index in range(self.count):
            launch = APIServerLaunch(
                self.server_configs[index],
                index,
                outputs[index],
                endpoints,
                listener.fileno(),
                metrics_dir,
                self.options,
            )
            server = ChildProcess(
                "asyncengine.entrypoints.openai.api_server_proc",
                msgspec.msgpack.encode(launch),
                name=f"APIServer-{index}",
                pass_fds=(listener.fileno(),),
            )
            await anyio.to_thread.run_sync(server.start)
            self.servers.append(server)
        logger.info(
            "serving on %s:%d with %d API server processes and %d engine core(s)",
            self.options.host,
            listener.getsockname()[1],
            self.count,
            len(self.cores),
        )
        return await self._watch()

    async def _watch(self) -> int:
        """Until a death that ends the group (1); a signal cancels it."""
        status = 0
        async with anyio.create_task_group() as tg:

            async def on_server_death(index: int, server: ChildProcess) -> None:
                nonlocal status
                await anyio.wait_readable(server.sentinel)
                await anyio.to_thread.run_sync(server.join, 1.0)
                logger.error(
                    "API server %d (pid %s) died (%s): stopping every process",
                    index,
                    server.pid,
                    exit_desc(server),
                )
                status = 1
                tg.cancel_scope.cancel()

            async def on_cores_death() -> None:
                nonlocal status
                for core in self.cores:
                    while not await core.wait_exit():
                        pass
                logger.error("every engine core died: stopping every process")
                status = 1
                tg.cancel_scope.cancel()

            tg.start_soon(on_cores_death)
            for index, server in enumerate(self.servers):
                tg.start_soon(on_server_death, index, server)
        return status

    async def _stop_all(self) -> None:
        """SIGTERM every API server (each drains), wait for them, then stop the cores
        (shielded; once)."""
        if self._stopping:
            return
        self._stopping = True
        with anyio.CancelScope(shield=True):
            # New connections are refused once no process holds the socket: the API servers
            # close theirs as they start to drain.
            if self._listener is not None:
                self._listener.close()
            for server in self.servers:
                server.terminate()
            timeout = self.options.shutdown_timeout + _STOP_GRACE_S
            async with anyio.create_task_group() as tg:
                for server in self.servers:
                    tg.start_soon(_join_or_kill, server, timeout)
            async with anyio.create_task_group() as tg:
                for core in self.cores:
                    tg.start_soon(core.stop)


async def _join_or_kill(proc: ChildProcess, grace_s: float) -> None:
    """Wait `grace_s` for `proc` to exit by itself, then stop it (and what it started)."""
    await anyio.to_thread.run_sync(proc.join, grace_s)
    if proc.is_alive():
        logger.warning("%s did not stop within %.0f s: killing it", proc.name, grace_s)
    await anyio.to_thread.run_sync(stop_process_tree, proc, False)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket every API server accepts on (inherited by each)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(_LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock
