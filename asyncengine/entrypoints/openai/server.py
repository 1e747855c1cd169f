"""Running the app under uvicorn, with a graceful shutdown on SIGTERM / SIGINT.

`Server.run_owning_engine()` starts the engine first: a start-up failure raises its error
(EngineStartupError with the root cause) before the server listens, and a signal during the
start-up stops it. Then it serves until SIGTERM or SIGINT (Ctrl-C). Shutdown, in order
(uvicorn's steps, plus step 3):

1. stop accepting connections; close idle keep-alive ones; new requests on busy connections
   get 503 (the server state is `draining`), as does /health;
2. let requests in flight finish, for up to `drain_timeout` seconds (`AsyncLLM.drain`);
3. then abort the rest: each stream ends with finish_reason "abort" and `data: [DONE]`;
   a second signal skips the rest of the drain and aborts at once (a third: uvicorn's force
   exit, which stops waiting for connections);
4. the engine stops (its core process and workers);
5. exit with status 0: a requested shutdown that completed is a success. (uvicorn on its own
   re-raises the signal after shutting down, so that the process dies *by* it.)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette

from asyncengine.entrypoints.openai.app import server_state
from asyncengine.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)
# Shutdown progress goes where uvicorn's own lines go, in their format and at their level.
_uvicorn_logger = logging.getLogger("uvicorn.error")

# Long enough for a typical completion to finish, short enough for an orchestrator's grace
# period (Kubernetes waits 30 s before SIGKILL by default: set its grace period longer).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After the aborts, how long uvicorn waits for responses to finish before cancelling them.
_ABORT_GRACE_S = 2
_SIGNAL_POLL_S = 0.05


class Server(uvicorn.Server):
    """uvicorn's server, with the engine-aware shutdown described above."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        drain_timeout: float,
        *,
        handle_sigint: bool = True,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        # An API server process of `serve --api-server-count` leaves Ctrl-C to its manager,
        # which sends it SIGTERM (a terminal's SIGINT reaches the whole process group).
        self.handle_sigint = handle_sigint
        self.stop_now = False  # a second signal: abort what is in flight, stop at once

    def run_owning_engine(self, sockets: list[socket.socket] | None = None) -> None:
        """`run()`, with the app's engine started before the server and stopped after it.

        A failed start raises its error (EngineStartupError with the root cause) before the
        server listens, rather than as uvicorn's "Application startup failed"; a signal during
        the start-up stops it, and this returns. From the main thread (signals reach only it).
        """
        anyio.run(
            self._serve_owning_engine,
            sockets,
            backend="asyncio",  # uvicorn's
            backend_options={"loop_factory": self.config.get_loop_factory()},
        )

    async def _serve_owning_engine(self, sockets: list[socket.socket] | None) -> None:
        # The server's signal handling from the start: a signal during the engine's start-up
        # sets should_exit, which cancels the start-up.
        failure: Exception | None = None
        with self.capture_signals():
            watch = anyio.CancelScope()
            async with anyio.create_task_group() as tg:

                async def stop_start_up_on_signal() -> None:
                    with watch:
                        await _signalled(lambda: self.should_exit)
                        _uvicorn_logger.info("Stopping during the engine's start-up")
                        tg.cancel_scope.cancel()

                tg.start_soon(stop_start_up_on_signal)
                try:
                    async with self.state.engine:
                        watch.cancel()
                        await self.serve(sockets)  # the app leaves a running engine to us
                except Exception as exc:
                    failure = exc  # raised as itself below, not in an exception group
                    tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Called in a signal handler: only flags here; the shutdown's tasks act on them.
        if not self.should_exit:
            self.should_exit = True  # 1st signal: drain
        elif not self.stop_now:
            self.stop_now = True  # 2nd: abort what is in flight, go on with the shutdown
        else:
            self.force_exit = True  # 3rd: uvicorn stops waiting for connections

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; a server in a thread is stopped by
            return  # setting should_exit
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self.handle_exit)}
        previous[signal.SIGINT] = signal.signal(
            signal.SIGINT, self.handle_exit if self.handle_sigint else signal.SIG_IGN
        )
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        self.state.draining = True
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._abort_after_drain)
            await super().shutdown(sockets)
            tg.cancel_scope.cancel()

    async def _abort_after_drain(self) -> None:
        """Drain (up to drain_timeout, or until a second signal), then abort what is left."""
        in_flight = len(self.state.in_flight)
        if in_flight:
            # (An API server process's manager says how to stop at once.)
            hint = " (Ctrl-C again stops at once)" if self.handle_sigint else ""
            _uvicorn_logger.info(
                "Draining %d request(s) in flight for up to %g s%s",
                in_flight,
                self.drain_timeout,
                hint,
            )
        async with anyio.create_task_group() as tg:

            async def on_second_signal() -> None:
                await _signalled(lambda: self.stop_now)
                tg.cancel_scope.cancel()

            tg.start_soon(on_second_signal)
            await self._drain()
            tg.cancel_scope.cancel()
        aborted = self.state.abort_all()
        if aborted:
            why = "on a second signal" if self.stop_now else "past the drain timeout"
            _uvicorn_logger.warning(
                "Shutdown: aborted %d request(s) still running, %s", aborted, why
            )

    async def _drain(self) -> None:
        engine = self.state.engine
        if engine.is_running:
            # No new engine request from here on; those in flight finish or, at the
            # timeout, end with finish_reason "abort".
            await engine.drain(self.drain_timeout)
        else:
            await anyio.sleep(self.drain_timeout)


async def _signalled(flag: Callable[[], bool]) -> None:
    """Return once `flag()` is true: a flag that a signal handler sets, polled (as uvicorn
    polls should_exit): setting an event from a signal handler, which may run in the middle
    of the event loop's own code, is not safe."""
    while not flag():  # noqa: ASYNC110
        await anyio.sleep(_SIGNAL_POLL_S)


def make_server(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    log_level: str = "info",
    access_log: bool = True,
    log_config: dict[str, Any] | None = uvicorn.config.LOGGING_CONFIG,
    handle_sigint: bool = True,
) -> Server:
    """A uvicorn server for an app made by `build_app`; `run()` it, or `serve()` it from a
    running asyncio loop. Port 0 picks a free port (uvicorn logs the one it got)."""
    if not drain_timeout >= 0:
        raise ValueError(f"drain_timeout={drain_timeout!r} must be >= 0")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        ws="none",
        log_level=log_level,
        access_log=access_log,
        log_config=log_config,
        timeout_graceful_shutdown=int(drain_timeout) + 1 + _ABORT_GRACE_S,
    )
    return Server(config, server_state(app), drain_timeout, handle_sigint=handle_sigint)
