"""Running the app under uvicorn, with a graceful shutdown on SIGTERM / SIGINT.

Shutdown, in order (uvicorn's steps, plus step 3):

1. stop accepting connections; close idle keep-alive ones; new requests on busy connections
   get 503 (the server state is `draining`), as does /health;
2. let requests in flight finish, for up to `drain_timeout` seconds (`AsyncLLM.drain`);
3. then abort the rest: each stream ends with finish_reason "abort" and `data: [DONE]`;
4. the app's lifespan stops the engine (its core process and workers);
5. exit with status 0: a requested shutdown that completed is a success. (uvicorn on its own
   re-raises the signal after shutting down, so that the process dies *by* it.)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Generator
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette

from asyncengine.entrypoints.openai.app import server_state
from asyncengine.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)

# Long enough for a typical completion to finish, short enough for an orchestrator's grace
# period (Kubernetes waits 30 s before SIGKILL by default: set its grace period longer).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After the aborts, how long uvicorn waits for responses to finish before cancelling them.
_ABORT_GRACE_S = 2


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
            tg.start_soon(self._abort_after_drain_timeout)
            await super().shutdown(sockets)
            tg.cancel_scope.cancel()

    async def _abort_after_drain_timeout(self) -> None:
        engine = self.state.engine
        if engine.is_running:
            # No new engine request from here on; those in flight finish or, at the
            # timeout, end with finish_reason "abort".
            await engine.drain(self.drain_timeout)
        else:
            await anyio.sleep(self.drain_timeout)
        aborted = self.state.abort_all()
        if aborted:
            logger.warning("shutdown: aborted %d request(s) still running", aborted)


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
