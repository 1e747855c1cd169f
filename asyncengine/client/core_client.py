"""EngineCoreClient: how AsyncLLM reaches its engine core, in another process or a thread.

- ProcCoreClient: the core in its own process (`python -m asyncengine.core.engine_core_proc`,
  a fresh interpreter: no entry-point guard needed), over ZMQ (msgpack frames, ipc:// sockets
  in a private 0700 directory). Sockets are driven from the event loop without zmq.asyncio, so every
  anyio backend works: sends use NOBLOCK (a connecting PUSH socket queues, never blocks), and
  receives await `anyio.wait_readable` on the socket's edge-triggered FD.
- ThreadCoreClient: the same busy loop (EngineCoreLoop) in a background thread of this process,
  with no sockets; outputs come back through a deque and a wake-up pipe.

Methods named `*_nowait` never block and may be called from the event loop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.client.core_process import CoreProcess, readable, socket_fd
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError, describe_exception
from asyncengine.ipc.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)
from asyncengine.ipc.serial import (
    MsgpackEncoder,
    RequestPayload,
    encode_request,
    outputs_decoder,
)
from asyncengine.ipc.sockets import (
    ipc_address,
    make_private_socket_dir,
    make_socket,
    remove_socket_dir,
    sweep_stale_socket_dirs,
)

if TYPE_CHECKING:
    from asyncengine.core.engine_core import EngineCore
    from asyncengine.core.engine_core_proc import EngineCoreLoop

logger = logging.getLogger(__name__)

_SHUTDOWN_JOIN_S = 5.0  # a core thread stuck in a step is given this long
# The core sends something at least every HEARTBEAT_INTERVAL_S (0.5 s); silent this long, it
# is stopped or hung: health checks fail at once. Silent past its step_timeout, it is dead.
UNRESPONSIVE_AFTER_S = 3.0
_MAX_OUTPUTS_PER_BATCH = 64  # messages taken per get_outputs(), to keep the loop responsive


@dataclass(frozen=True, slots=True)
class RankDied:
    """Among the outputs: one data-parallel rank is gone while others serve on.

    `request_ids` are the core request ids that were on it: their streams end with
    EngineDeadError. (When the last rank goes, or with data_parallel_fail_fast, the engine
    as a whole is dead instead: `wait_dead()` returns.)
    """

    rank: int
    reason: str
    request_ids: list[str]


class EngineCoreClient(ABC):
    """The client's end of the engine core (or of several, with data parallel)."""

    num_kv_blocks: int = 0  # known once the core is ready (the sum over the ranks)

    async def launch(self) -> None:
        """Set the core's start-up going without waiting for it; `start()` then waits.

        Optional (`start()` launches a core not yet launched): it lets the caller do its own
        start-up work while the core starts. A no-op where the core cannot start on its own.
        """
        return None

    @abstractmethod
    async def start(self) -> None:
        """Start the core and wait until it serves; EngineStartupError with the root cause."""

    @abstractmethod
    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request; with data parallel, to `data_parallel_rank` or where the router
        says (the n > 1 copies of one request, `id#i`, go where their first went)."""

    @abstractmethod
    def abort_requests_nowait(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def call_utility_nowait(self, call: UtilityCall) -> None:
        """Send a utility call; its UtilityResult arrives among the outputs (with data
        parallel: one result, combining every live rank's)."""

    @abstractmethod
    async def get_outputs(self) -> list[EngineCoreOutputs | RankDied]:
        """Wait for outputs from the core and return every message that has arrived."""

    @abstractmethod
    async def wait_dead(self) -> str:
        """Return, with a reason, when the core has died by itself (never on shutdown()),
        or has been silent past its step_timeout (it is then killed). With data parallel:
        when no rank is left (or one died, with data_parallel_fail_fast)."""

    def silent_for(self) -> float:
        """Seconds since the core was last heard from (0 where it cannot be silent)."""
        return 0.0

    def rank_errors(self) -> dict[int, str]:
        """Data-parallel ranks that died, with why (the engine serves on the others)."""
        return {}

    @property
    def data_parallel_size(self) -> int:
        return 1

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core and join every thread and process; idempotent, cancel-safe."""


# ---- the core in a spawned process ------------------------------------------------------------


class ProcCoreClient(EngineCoreClient):
    """One core process (CoreProcess), its input (PUSH) and output (PULL) sockets."""

    def __init__(self, config: EngineConfig, startup_timeout: float) -> None:
        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket_dir = make_private_socket_dir()
        self.core = CoreProcess(
            self._ctx, config, self._socket_dir, startup_timeout=startup_timeout
        )
        self._output_address = ipc_address(self._socket_dir, "output")
        self._output: zmq.Socket[bytes] | None = None
        self._input: zmq.Socket[bytes] | None = None
        self._encoder = MsgpackEncoder()
        self._shut_down = False
        self._last_heard = time.monotonic()  # any message, heartbeats included

    @property
    def socket_dir(self) -> Path:
        return self._socket_dir

    @property
    def proc(self) -> ChildProcess | None:
        return self.core.proc

    async def launch(self) -> None:
        try:
            await self._launch()
        except BaseException:
            await self.shutdown()
            raise

    async def start(self) -> None:
        try:
            await self._launch()
            # HELLO → our addresses → READY, then connect to the input socket it bound.
            await self.core.wait_ready([self._output_address])
            self.num_kv_blocks = self.core.num_kv_blocks
            self._input = make_socket(self._ctx, self.core.input_address, zmq.PUSH, bind=False)
        except BaseException:
            await self.shutdown()
            raise

    async def _launch(self) -> None:
        if self._output is None:
            self._output = make_socket(self._ctx, self._output_address, zmq.PULL, bind=True)
        await self.core.launch()

    def _send(self, request_type: EngineCoreRequestType, payload: RequestPayload) -> None:
        if self._input is None:
            return  # shut down: nothing to send to
        # A connecting PUSH socket with no high-water mark queues: NOBLOCK never fails here.
        self._input.send_multipart(
            encode_request(self._encoder, request_type, payload), zmq.NOBLOCK
        )

    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def call_utility_nowait(self, call: UtilityCall) -> None:
        self._send(EngineCoreRequestType.UTILITY, call)

    async def get_outputs(self) -> list[EngineCoreOutputs | RankDied]:
        sock = self._output
        assert sock is not None
        frames = await recv_frames(sock)
        self._last_heard = time.monotonic()
        return list(decode_outputs(frames))

    def silent_for(self) -> float:
        return time.monotonic() - self._last_heard

    async def wait_dead(self) -> str:
        core = self.core
        self._last_heard = time.monotonic()  # serving starts now
        limit = self.config.step_timeout
        while not await core.wait_exit():
            silent = self.silent_for()
            if silent > limit:
                # Stopped (SIGSTOP) or hung beyond its own watchdog: it will never answer.
                await core.stop(kill=True)
                return (
                    f"engine core process (pid {core.pid}) sent nothing for {silent:.1f} s, "
                    f"past step_timeout={limit:g} s: it was stopped or hung, and is killed"
                )
        return f"engine core process (pid {core.pid}) died: {core.exit_desc()}"

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        with anyio.CancelScope(shield=True):
            if self._input is not None:
                self._input.close(linger=0)
            self._input = None
            await self.core.stop()
            if self._output is not None:
                self._output.close(linger=0)
            self._ctx.term()
            remove_socket_dir(self._socket_dir)
            # A core killed before its own clean-up leaves its executor's directory: the
            # core is gone now, so the sweep takes it.
            sweep_stale_socket_dirs()


async def recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Wait until `sock` has messages; take up to _MAX_OUTPUTS_PER_BATCH of them."""
    fd = socket_fd(sock)
    while True:
        frames: list[bytes] = []
        while len(frames) < _MAX_OUTPUTS_PER_BATCH:
            try:
                frames.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        if frames:
            return frames
        if readable(sock):
            continue
        await anyio.wait_readable(fd)


def decode_outputs(frames: list[bytes]) -> Iterator[EngineCoreOutputs]:
    for frame in frames:
        try:
            yield outputs_decoder.decode(frame)
        except msgspec.DecodeError as exc:
            logger.warning("dropped a malformed frame from the engine core: %s", exc)


# ---- the core in a thread of this process -----------------------------------------------------


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
            while self._outputs and len(batch) < _MAX_OUTPUTS_PER_BATCH:
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
