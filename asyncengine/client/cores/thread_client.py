"""ThreadCoreClient: the engine core's busy loop in a background thread of this process.

The same loop (EngineCoreLoop) as a core process runs, with no sockets and no second process
(notebooks, tests); outputs come back through a deque and a wake-up pipe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import anyio

from asyncengine.client.cores.client import MAX_OUTPUTS_PER_BATCH, EngineCoreClient, RankDied
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError, describe_exception
from asyncengine.ipc.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)

if TYPE_CHECKING:
    from asyncengine.core.engine_core import EngineCore
    from asyncengine.core.engine_core_proc import EngineCoreLoop

logger = logging.getLogger(__name__)

_SHUTDOWN_JOIN_S = 5.0  # a core thread stuck in a step is given this long


class ThreadCoreClient(EngineCoreClient):
    """EngineCoreLoop in a background thread: no sockets, no second process (notebooks, tests)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_core: EngineCore | None = None
        self._loop: EngineCoreLoop | None = None
        self._thread: threading.Thread | None = None
        self._outputs: collections.deque[EngineCoreOutputs] = collections.deque()
        self._stop_watchdog = threading.Event()
        self._hung = False  # the watchdog found a step past step_timeout
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._shut_down = False

    async def start(self) -> None:
        # The core pulls in torch: import it only when this client is used.
        from asyncengine.core.engine_core import EngineCore, import_model_code
        from asyncengine.core.engine_core_proc import EngineCoreLoop

        def build() -> EngineCore:
            import_model_code(self.config, owns_process=False)
            return EngineCore(self.config)

        try:
            self.engine_core = await anyio.to_thread.run_sync(build)
        except Exception as exc:
            await self.shutdown()
            raise EngineStartupError(
                f"engine core failed to start: {describe_exception(exc)}"
            ) from exc
        self.num_kv_blocks = self.engine_core.num_kv_blocks
        self._loop = EngineCoreLoop(self.engine_core, self._emit)
        self._thread = threading.Thread(target=self._run, name="AsyncEngineCore", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="EngineCoreWatchdog", daemon=True).start()

    def _watch(self) -> None:
        """A step past step_timeout is a death here too: every stream hears it, though the
        stuck thread itself cannot be stopped (it is a daemon; the process can exit)."""
        assert self._loop is not None
        reason = self._loop.watch_steps(self.config.step_timeout, self._stop_watchdog)
        if reason is not None:
            logger.error("%s", reason)
            self._hung = True
            self._emit(EngineCoreOutputs(engine_dead=reason))

    def _run(self) -> None:
        assert self._loop is not None
        try:
            self._loop.run_busy_loop()
        except BaseException as exc:
            logger.exception("engine core failed")
            self._emit(EngineCoreOutputs(engine_dead=describe_exception(exc)))

    def _emit(self, outputs: EngineCoreOutputs, client: int | None = None) -> None:
        # Called from the core's thread.
        self._outputs.append(outputs)
        # A full pipe means a wake-up is pending already; a closed one, that we shut down.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _put(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self._loop is not None and not self._shut_down:
            self._loop.input_queue.put((request_type, payload))

    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        self._put(EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._put(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility_nowait(self, call: UtilityCall) -> None:
        self._put(EngineCoreRequestType.UTILITY, call)

    async def get_outputs(self) -> list[EngineCoreOutputs | RankDied]:
        while True:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            batch: list[EngineCoreOutputs | RankDied] = []
            while self._outputs and len(batch) < MAX_OUTPUTS_PER_BATCH:
                batch.append(self._outputs.popleft())
            if batch:
                return batch
            await anyio.wait_readable(self._wake_r)

    async def wait_dead(self) -> str:
        # The thread reports its own death with ENGINE_CORE_DEAD among the outputs.
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self._stop_watchdog.set()
        with anyio.CancelScope(shield=True):
            if self._loop is not None:
                self._loop.shutdown_nowait()
            if self._thread is not None:
                # A hung step never returns: leave that daemon thread behind, after a grace.
                timeout = _SHUTDOWN_JOIN_S if self._hung else None
                await anyio.to_thread.run_sync(self._thread.join, timeout)
                if self._thread.is_alive():
                    logger.warning("the engine core's thread is stuck in a step: abandoned")
            if self.engine_core is not None and not self._hung:
                self.engine_core.shutdown()
            os.close(self._wake_r)
            os.close(self._wake_w)
