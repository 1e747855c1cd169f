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
import signal
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError, describe_exception
from asyncengine.ipc.messages import (
    EngineCoreLaunch,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HandshakeAddresses,
    HandshakeFailed,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
    UtilityCall,
)
from asyncengine.ipc.serial import (
    MsgpackEncoder,
    RequestPayload,
    encode_request,
    handshake_decoder,
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

_SHUTDOWN_JOIN_S = 5.0  # terminate → join this long → kill
# The core sends something at least every HEARTBEAT_INTERVAL_S (0.5 s); silent this long, it
# is stopped or hung: health checks fail at once. Silent past its step_timeout, it is dead.
UNRESPONSIVE_AFTER_S = 3.0
_MAX_OUTPUTS_PER_BATCH = 64  # messages taken per get_outputs(), to keep the loop responsive


class EngineCoreClient(ABC):
    """The client's end of one engine core."""

    num_kv_blocks: int = 0  # known once the core is ready

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
    def add_request_nowait(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests_nowait(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def call_utility_nowait(self, call: UtilityCall) -> None:
        """Send a utility call; its UtilityResult arrives among the outputs."""

    @abstractmethod
    async def get_outputs(self) -> list[EngineCoreOutputs]:
        """Wait for outputs from the core and return every message that has arrived."""

    @abstractmethod
    async def wait_dead(self) -> str:
        """Return, with a reason, when the core has died by itself (never on shutdown()),
        or has been silent past its step_timeout (it is then killed)."""

    def silent_for(self) -> float:
        """Seconds since the core was last heard from (0 where it cannot be silent)."""
        return 0.0

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core and join every thread and process; idempotent, cancel-safe."""


# ---- the core in a spawned process ------------------------------------------------------------


class ProcCoreClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, startup_timeout: float) -> None:
        self.config = config
        self.startup_timeout = startup_timeout
        self.proc: ChildProcess | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket_dir = make_private_socket_dir()
        self._handshake_address = ipc_address(self._socket_dir, "handshake")
        self.input_address = ipc_address(self._socket_dir, "input")
        self._output_address = ipc_address(self._socket_dir, "output")
        self._handshake: zmq.Socket[bytes] | None = None
        self._output: zmq.Socket[bytes] | None = None
        self._input: zmq.Socket[bytes] | None = None
        self._encoder = MsgpackEncoder()
        self._deadline = 0.0  # for READY, set when the core is spawned
        self._shut_down = False
        self._last_heard = time.monotonic()  # any message, heartbeats included

    @property
    def socket_dir(self) -> Path:
        return self._socket_dir

    async def launch(self) -> None:
        try:
            await self._launch()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise

    async def start(self) -> None:
        try:
            await self._launch()
            await self._start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise

    async def _launch(self) -> None:
        """Bind the handshake and output sockets, then start the core's process (once)."""
        if self.proc is not None:
            return
        self._deadline = time.monotonic() + self.startup_timeout
        self._handshake = make_socket(self._ctx, self._handshake_address, zmq.ROUTER, bind=True)
        self._output = make_socket(self._ctx, self._output_address, zmq.PULL, bind=True)
        launch = EngineCoreLaunch(self.config, self._handshake_address)
        self.proc = ChildProcess(
            "asyncengine.core.engine_core_proc",
            self._encoder.encode(launch),
            name="AsyncEngineCore",
        )
        await anyio.to_thread.run_sync(self.proc.start)

    async def _start(self) -> None:
        # 1. Sockets bound and the core spawned (_launch). 2. HELLO → our addresses.
        handshake, deadline = self._handshake, self._deadline
        assert handshake is not None
        identity, hello = await self._recv_handshake(deadline)
        if not isinstance(hello, HandshakeHello):
            raise EngineStartupError(f"engine core sent {type(hello).__name__} before HELLO")
        addresses = HandshakeAddresses(self.input_address, self._output_address)
        handshake.send_multipart([identity, self._encoder.encode(addresses)])
        # 3. READY (model loaded, KV cache allocated) or FAILED with the root cause.
        _, message = await self._recv_handshake(deadline)
        if isinstance(message, HandshakeFailed):
            raise EngineStartupError(f"engine core failed to start: {message.error}")
        if not isinstance(message, HandshakeReady):
            raise EngineStartupError(f"engine core sent {type(message).__name__}, not READY")
        self.num_kv_blocks = message.num_kv_blocks
        handshake.close()
        # 4. The core has bound its input socket: connect to it.
        self._input = make_socket(self._ctx, self.input_address, zmq.PUSH, bind=False)

    async def _recv_handshake(self, deadline: float) -> tuple[bytes, HandshakeMessage]:
        sock, proc = self._handshake, self.proc
        assert sock is not None and proc is not None
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
            if _readable(sock):
                continue
            now = time.monotonic()
            if not proc.is_alive():
                # A FAILED message sent just before the exit may still be in flight.
                died_at = died_at or now
                if now - died_at > 0.5:
                    raise EngineStartupError(
                        f"engine core process exited during start-up ({_exit_desc(proc)}); "
                        "see its log above for the cause"
                    )
            if now > deadline:
                raise EngineStartupError(
                    f"engine core did not become ready within {self.startup_timeout} s"
                )
            with anyio.move_on_after(min(0.1, deadline - now)):
                await anyio.wait_readable(_fd(sock))

    def _send(self, request_type: EngineCoreRequestType, payload: RequestPayload) -> None:
        if self._input is None:
            return  # shut down: nothing to send to
        # A connecting PUSH socket with no high-water mark queues: NOBLOCK never fails here.
        self._input.send_multipart(
            encode_request(self._encoder, request_type, payload), zmq.NOBLOCK
        )

    def add_request_nowait(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def call_utility_nowait(self, call: UtilityCall) -> None:
        self._send(EngineCoreRequestType.UTILITY, call)

    async def get_outputs(self) -> list[EngineCoreOutputs]:
        sock = self._output
        assert sock is not None
        fd = _fd(sock)
        while True:
            frames: list[bytes] = []
            while len(frames) < _MAX_OUTPUTS_PER_BATCH:
                try:
                    frames.append(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            if frames:
                self._last_heard = time.monotonic()
                return _decode_outputs(frames)
            if _readable(sock):
                continue
            await anyio.wait_readable(fd)

    def silent_for(self) -> float:
        return time.monotonic() - self._last_heard

    async def wait_dead(self) -> str:
        proc = self.proc
        assert proc is not None
        self._last_heard = time.monotonic()  # serving starts now
        limit = self.config.step_timeout
        while True:
            with anyio.move_on_after(0.5):
                await anyio.wait_readable(proc.sentinel)
                break
            silent = self.silent_for()
            if silent > limit:
                # Stopped (SIGSTOP) or hung beyond its own watchdog: it will never answer.
                await anyio.to_thread.run_sync(_stop_process_tree, proc, True)
                return (
                    f"engine core process (pid {proc.pid}) sent nothing for {silent:.1f} s, "
                    f"past step_timeout={limit:g} s: it was stopped or hung, and is killed"
                )
        # The sentinel closes as the process exits, a moment before it can be reaped.
        await anyio.to_thread.run_sync(proc.join, 1.0)
        return f"engine core process (pid {proc.pid}) died: {_exit_desc(proc)}"

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        with anyio.CancelScope(shield=True):
            for sock in (self._input, self._handshake):
                if sock is not None:
                    sock.close(linger=0)
            self._input = None
            if self.proc is not None and self.proc.pid is not None:
                await anyio.to_thread.run_sync(_stop_process_tree, self.proc)
            if self._output is not None:
                self._output.close(linger=0)
            self._ctx.term()
            remove_socket_dir(self._socket_dir)
            # A core killed before its own clean-up leaves its executor's directory: the
            # core is gone now, so the sweep takes it.
            sweep_stale_socket_dirs()


def _fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's edge-triggered notification FD (readable when its events may have changed)."""
    return int(sock.getsockopt(zmq.FD))


def _readable(sock: zmq.Socket[bytes]) -> bool:
    # Reading EVENTS also re-arms the FD's edge: check it before waiting again.
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _decode_outputs(frames: list[bytes]) -> list[EngineCoreOutputs]:
    decoded = []
    for frame in frames:
        try:
            decoded.append(outputs_decoder.decode(frame))
        except msgspec.DecodeError as exc:
            logger.warning("dropped a malformed frame from the engine core: %s", exc)
    return decoded


def _stop_process_tree(proc: ChildProcess, kill: bool = False) -> None:
    """terminate → join (5 s) → kill, for the core and every process it started; with
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
        proc.join(_SHUTDOWN_JOIN_S)
    if proc.is_alive():
        logger.warning("engine core did not stop within %.0f s: killing it", _SHUTDOWN_JOIN_S)
        proc.kill()
        proc.join(_SHUTDOWN_JOIN_S)
    for child in children:
        with contextlib.suppress(psutil.Error):  # already gone
            child.kill()
    psutil.wait_procs(children, timeout=_SHUTDOWN_JOIN_S)
    proc.join(timeout=0)
    proc.close()


def _exit_desc(proc: ChildProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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

    def _emit(self, outputs: EngineCoreOutputs) -> None:
        # Called from the core's thread.
        self._outputs.append(outputs)
        # A full pipe means a wake-up is pending already; a closed one, that we shut down.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _put(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self._loop is not None and not self._shut_down:
            self._loop.input_queue.put((request_type, payload))

    def add_request_nowait(self, request: EngineCoreRequest) -> None:
        self._put(EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._put(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility_nowait(self, call: UtilityCall) -> None:
        self._put(EngineCoreRequestType.UTILITY, call)

    async def get_outputs(self) -> list[EngineCoreOutputs]:
        while True:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            batch: list[EngineCoreOutputs] = []
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
