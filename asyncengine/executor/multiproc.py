"""MultiprocExecutor: one spawned worker process per tensor-parallel rank.

    engine core ──ExecuteModel / RpcCall──► PUSH socket per rank ──► worker rank r
    engine core ◄──ExecuteResult / RpcResult / WorkerFailure── one PULL socket ◄── every rank

A step's SchedulerOutput is encoded once (msgpack) and the same bytes go to every rank; only
rank 0 answers a step (the others answer only when it fails). Calls are made from one thread
(the engine core's busy loop), one at a time. Waiting for an answer also watches the
WorkerMonitor, so a dead worker turns into an error within a poll interval, never a hang.

This module imports no torch: the engine-core process only routes messages.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.executor.abstract import Executor, GrammarFill
from asyncengine.executor.worker_monitor import WorkerMonitor
from asyncengine.ipc.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.ipc.sockets import (
    ipc_address,
    make_private_socket_dir,
    make_socket,
    remove_socket_dir,
)
from asyncengine.ipc.worker_messages import (
    ExecuteModel,
    ExecuteResult,
    FromWorker,
    InitDistributed,
    RpcCall,
    RpcResult,
    Shutdown,
    WorkerFailure,
    WorkerHello,
    WorkerLaunch,
    WorkerReady,
    from_worker_decoder,
)

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often a wait looks at the monitor
_STARTUP_TIMEOUT_S = 300.0  # loading and sharding a large model takes a while
_SHUTDOWN_JOIN_S = 5.0
# A rank whose peer was killed fails its collective at once ("connection closed by peer"),
# often before the monitor has reaped the dead peer: wait this long for the root cause.
_DEATH_GRACE_S = 0.25


class WorkerError(RuntimeError):
    """A call raised inside a worker; the message carries the worker's traceback text."""


class WorkerDiedError(RuntimeError):
    """A worker process exited while the executor was waiting on it."""


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.tensor_parallel_size
        self._lock = threading.Lock()  # one call in flight at a time
        self._next_id = 0
        self._closed = False
        self._death: str | None = None
        self._broken = False  # a step failed: the other ranks may never answer again
        self._procs: list[ChildProcess] = []
        self._monitor: WorkerMonitor | None = None
        self._socket_dir = make_private_socket_dir()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._results = make_socket(
            self._ctx, ipc_address(self._socket_dir, "results"), zmq.PULL, bind=True
        )
        self._inboxes: list[zmq.Socket[bytes]] = []
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    # ---- startup -------------------------------------------------------------------------

    def _start_workers(self) -> None:
        """1. start the ranks' processes, 2. HELLOs, 3. InitDistributed (the ranks
        rendezvous through a FileStore in our private directory), 4. WorkerReady from every
        rank (the model is loaded and sharded).

        Each rank is a fresh interpreter (`python -m asyncengine.executor.worker_proc`) that
        exits when its owner does, even one that never calls shutdown() (its stdin closes)."""
        results_address = ipc_address(self._socket_dir, "results")
        store_path = str(self._socket_dir / "rendezvous")
        for rank in range(self.world_size):
            address = ipc_address(self._socket_dir, f"worker-{rank}")
            self._inboxes.append(make_socket(self._ctx, address, zmq.PUSH, bind=True))
            launch = WorkerLaunch(
                rank, self.world_size, self.config, address, results_address, store_path
            )
            proc = ChildProcess(
                "asyncengine.executor.worker_proc",
                self._encoder.encode(launch),
                name=f"AsyncEngineWorker-{rank}",
            )
            proc.start()
            self._procs.append(proc)
        self._monitor = WorkerMonitor(self._procs, self._on_worker_death)
        self._monitor.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        hellos = [self._recv(WorkerHello, -1, deadline) for _ in range(self.world_size)]
        self._broadcast(self._encoder.encode(InitDistributed()))
        for _ in range(self.world_size):
            self._recv(WorkerReady, -1, deadline)
        logger.info(
            "%d workers ready: pids %s", self.world_size, ", ".join(str(h.pid) for h in hellos)
        )

    # ---- calls ---------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        with self._lock:
            call_id = self._new_id()
            self._broadcast(
                self._encoder.encode(RpcCall(call_id, method, list(args), kwargs or {}))
            )
            deadline = None if timeout is None else time.monotonic() + timeout
            results: dict[int, Any] = {}
            while len(results) < self.world_size:
                try:
                    reply = self._recv(RpcResult, call_id, deadline)
                except TimeoutError:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    raise TimeoutError(
                        f"collective_rpc({method!r}) timed out after {timeout} s waiting for "
                        f"worker ranks {missing}"
                    ) from None
                results[reply.rank] = reply.result
            return [results[rank] for rank in range(self.world_size)]

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_fill: GrammarFill | None = None
    ) -> ModelRunnerOutput:
        if grammar_fill is not None:  # not expected (overlaps_grammar_fill is False), but fine
            scheduler_output.grammar_bitmask = grammar_fill()
        with self._lock:
            step_id = self._new_id()
            self._broadcast(self._encoder.encode(ExecuteModel(step_id, scheduler_output)))
            result: ExecuteResult = self._recv(ExecuteResult, step_id, None)
            return result.output

    def check_health(self) -> None:
        if self._death is not None:
            raise WorkerDiedError(self._death)
        self.collective_rpc("check_health", timeout=10.0)

    # ---- plumbing ------------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _broadcast(self, frame: bytes) -> None:
        if self._death is not None:
            raise WorkerDiedError(self._death)
        for inbox in self._inboxes:
            inbox.send(frame, copy=False)

    def _recv(self, kind: type[Any], call_id: int, deadline: float | None) -> Any:
        """The next `kind` answer to `call_id`; raises a worker's failure, a death, or
        TimeoutError at `deadline`. Answers to earlier (timed-out) calls are dropped."""
        while True:
            if self._death is not None:
                raise WorkerDiedError(self._death)
            wait_ms = _POLL_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                wait_ms = min(wait_ms, max(1, int(left * 1000)))
            if not self._results.poll(wait_ms):
                continue
            message: FromWorker = from_worker_decoder.decode(self._results.recv(copy=False).buffer)
            if isinstance(message, WorkerFailure) and message.call_id == call_id:
                if kind is ExecuteResult:
                    # The other ranks may be stuck in a collective with the failed one.
                    self._broken = True
                error = WorkerError(
                    f"worker rank {message.rank} failed: {message.error}\n"
                    f"worker traceback:\n{message.traceback}"
                )
                death = self._wait_for_death(_DEATH_GRACE_S)
                if death is not None:
                    raise WorkerDiedError(death) from error
                raise error
            if _answers(message, kind, call_id):
                return message
            logger.debug("dropping a stale %s", type(message).__name__)

    def _wait_for_death(self, grace: float) -> str | None:
        """The monitor's death report if one comes within `grace` seconds, else None.

        A failure in one rank is often only the echo of a peer's death; the death is what
        the user needs to read, so it wins when both are known."""
        deadline = time.monotonic() + grace
        while self._death is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._death

    def _on_worker_death(self, reason: str) -> None:
        self._death = f"worker process failure: {reason}"
        self._notify_failure(self._death)

    # ---- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shutdown message → join → terminate → join → kill, then close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.stop()
        for inbox in self._inboxes:
            with contextlib.suppress(zmq.ZMQError):  # a closed peer: it is exiting anyway
                inbox.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
        grace = 0.5 if self._broken or self._death is not None else _SHUTDOWN_JOIN_S
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        # A rank blocked inside a collective runs no Python signal handler: don't wait long.
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning(
                    "worker %s (pid %s) ignored SIGTERM: killing it", proc.name, proc.pid
                )
                proc.kill()
                proc.join(timeout=1.0)
        for proc in self._procs:
            proc.close()
        for sock in (*self._inboxes, self._results):
            sock.close(linger=0)
        self._ctx.term()
        remove_socket_dir(self._socket_dir)


def _answers(message: FromWorker, kind: type[Any], call_id: int) -> bool:
    """Is `message` the `kind` of answer to `call_id`? (Startup answers name no call.)"""
    if not isinstance(message, kind):
        return False
    if isinstance(message, ExecuteResult):
        return message.step_id == call_id
    if isinstance(message, RpcResult):
        return message.call_id == call_id
    return True
