"""The engine core's busy loop, served from its own process (or a thread of the client).

The process is `python -m asyncengine.core.engine_core_proc`, started by the client as a
`ChildProcess` with its config on stdin: a fresh interpreter that never imports the
application's `__main__`.

In the process, three threads share the work, so the loop never waits on a socket:

    input IO thread:   input socket → RequestDecoder → input_queue
    main thread:       busy loop: input_queue → EngineCore.step() → output_queue
    output IO thread:  output_queue → msgpack (one reused buffer) → output socket

The executor's failure callback puts EXECUTOR_FAILED on input_queue; the loop raises, the
output thread sends ENGINE_CORE_DEAD (`EngineCoreOutputs.engine_dead`), and the process exits
non-zero. SIGTERM shuts it down cleanly; so does the death of its parent. SIGINT is ignored
(unless the launch says otherwise): a terminal's Ctrl-C reaches the whole process group, and
the core's owner is the one to act on it, stopping the core when it is done with it.

Nothing hangs: a watchdog thread ends the process (after ENGINE_CORE_DEAD) when a step runs
past `step_timeout`, and the output thread sends a heartbeat (an empty EngineCoreOutputs)
whenever it has sent nothing for HEARTBEAT_INTERVAL_S, so the client can tell a stopped core
from an idle one.

This module imports no torch at the top: the core imports the heavy parts only after saying
HELLO, so the client gets its first sign of life at once.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq

from asyncengine.child_process import read_payload
from asyncengine.errors import describe_exception
from asyncengine.heap import IDLE_RELEASE_S, release_free_heap
from asyncengine.ipc.messages import (
    CoreLoad,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    FinishReason,
    HandshakeAddresses,
    HandshakeFailed,
    HandshakeHello,
    HandshakeReady,
    UtilityCall,
    UtilityResult,
)
from asyncengine.ipc.serial import (
    MalformedFrameError,
    MsgpackEncoder,
    RequestDecoder,
    handshake_decoder,
    launch_decoder,
)
from asyncengine.ipc.sockets import make_socket
from asyncengine.process_setup import (
    hard_exit,
    install_signal_handlers,
    load_test_hooks,
    setup_logging,
    skip_unused_packages,
    start_parent_watch,
)

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig
    from asyncengine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# The core waits this long for the client's addresses after saying HELLO.
HANDSHAKE_TIMEOUT_S = 30.0
_IO_POLL_MS = 100  # IO threads look at their stop flag this often
HEARTBEAT_INTERVAL_S = 0.5  # the most the output socket stays silent while the core lives
_OUTPUT_LINGER_MS = 2000  # how long a closing output socket may flush ENGINE_CORE_DEAD

_SHUTDOWN = object()  # on input_queue: leave the busy loop; on output_queue: stop the IO thread

_LOAD_REPORT_INTERVAL_S = 0.05  # steps with no outputs report a changed load this often

InputItem = tuple[EngineCoreRequestType, Any] | object
# emit(outputs, client_index): send to that client, or to every client (None).
Emit = Callable[[EngineCoreOutputs, "int | None"], None]


class ExecutorFailedError(RuntimeError):
    """The executor reported a failure through its callback: the core cannot go on."""


class EngineCoreLoop:
    """The busy loop around one EngineCore; transport-agnostic.

    Requests arrive on `input_queue` as (EngineCoreRequestType, payload) pairs, or `_SHUTDOWN`;
    every EngineCoreOutputs worth sending goes to `emit`, with the index of the client it
    belongs to (several API server processes may share one core). `run_busy_loop` returns on
    shutdown and raises on a fatal error (the caller reports ENGINE_CORE_DEAD).
    """

    def __init__(
        self, engine_core: EngineCore, emit: Emit, num_clients: int = 1, rank: int = 0
    ) -> None:
        self.engine_core = engine_core
        self.emit = emit
        self.num_clients = num_clients
        self.rank = rank  # data-parallel rank
        # With several clients: the client of each request in the core, to route its outputs.
        self._client_of: dict[str, int] = {}
        self.last_load = CoreLoad(0, 0, 0.0)  # read by the output thread for heartbeats
        self._last_report = 0.0
        self.input_queue: queue.Queue[InputItem] = queue.Queue()
        self.step_started: float | None = None  # time.monotonic() of the step in progress
        self.paused = False  # no steps until resumed (AsyncLLM.pause_generation)
        # Idle this long after a step, the core hands the heap its steps freed back (heap.py).
        self.idle_release_s = IDLE_RELEASE_S
        self.release_heap: Callable[[], None] = release_free_heap
        self._stepped = False  # a step ran since the heap was last released
        # testing_* utility methods (fault injection), only where a test asked for them.
        self.test_hooks = load_test_hooks("CORE_HOOKS")
        engine_core.executor.register_failure_callback(self._on_executor_failure)

    def _on_executor_failure(self) -> None:
        self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, None))

    def watch_steps(self, step_timeout: float, stop: threading.Event) -> str | None:
        """Block until a step has run past `step_timeout` (then return why it is a death),
        or until `stop` is set (then None). For a watchdog thread beside the busy loop."""
        while not stop.wait(min(1.0, step_timeout / 4)):
            started = self.step_started
            if started is not None and time.monotonic() - started > step_timeout:
                return (
                    f"a step exceeded step_timeout={step_timeout:g} s (running for "
                    f"{time.monotonic() - started:.1f} s): the engine core is hung"
                )
        return None

    def shutdown_nowait(self) -> None:
        """Ask the loop to return after the step in progress (thread-safe)."""
        self.input_queue.put(_SHUTDOWN)

    def run_busy_loop(self) -> None:
        while True:
            # 1. Block on input_queue while idle, then take everything that has arrived.
            if not self._process_input_queue():
                return
            if self.paused:
                continue  # requests stay in place, their KV blocks kept, until resumed
            # 2. One step: schedule → execute → update (a no-op without requests).
            self.step_started = time.monotonic()
            outputs = self.engine_core.step()
            self.step_started = None
            self._stepped = True
            # 3. Hand the step's outputs on, with the load they leave (for the DP router).
            load = self.engine_core.load()
            if outputs.outputs:
                outputs.load = load
                self._emit_outputs(outputs)
            elif load != self.last_load and (
                time.monotonic() - self._last_report > _LOAD_REPORT_INTERVAL_S
            ):
                self.emit(EngineCoreOutputs(timestamp=time.monotonic(), load=load), None)
                self._last_report = time.monotonic()
            self.last_load = load

    def _emit_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Send each request's outputs to its own client (one message each)."""
        self._last_report = time.monotonic()
        if self.num_clients == 1:
            self.emit(outputs, 0)
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs.outputs:
            if output.finished:
                client = self._client_of.pop(output.request_id, 0)
            else:
                client = self._client_of.get(output.request_id, 0)
            by_client.setdefault(client, []).append(output)
        for client, group in by_client.items():
            self.emit(
                EngineCoreOutputs(outputs=group, timestamp=outputs.timestamp, load=outputs.load),
                client,
            )

    def _process_input_queue(self) -> bool:
        """Handle queued requests; False once SHUTDOWN is seen."""
        # has_requests, not has_work: a finished-ids list alone must not keep the loop spinning.
        block = self.paused or not self.engine_core.scheduler.has_requests()
        while True:
            try:
                item = self._next_input(block)
            except queue.Empty:
                return True
            block = False
            if item is _SHUTDOWN:
                return False
            request_type, payload = cast("tuple[EngineCoreRequestType, Any]", item)
            self._handle(request_type, payload)

    def _next_input(self, block: bool) -> InputItem:
        """The next queued item; raises queue.Empty if none and not `block`. A blocking wait
        that lasts `idle_release_s` after a step releases the heap once, then waits on."""
        if not block:
            return self.input_queue.get(block=False)
        if self._stepped:
            try:
                return self.input_queue.get(timeout=self.idle_release_s)
            except queue.Empty:
                self._stepped = False
                self.release_heap()
        return self.input_queue.get()

    def _handle(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            self._add_request(payload)
        elif request_type is EngineCoreRequestType.ABORT:
            aborted = self.engine_core.abort_requests(payload)
            if aborted:
                # Every request the core ends reaches its stream: the client ignores the ends
                # of requests it aborted itself, and an abort it did not send ends the stream.
                ends = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in aborted]
                self._emit_outputs(
                    EngineCoreOutputs(
                        outputs=ends, timestamp=time.monotonic(), load=self.engine_core.load()
                    )
                )
        elif request_type is EngineCoreRequestType.UTILITY:
            result = EngineCoreOutputs(utility_output=self._call_utility(payload))
            self.emit(result, payload.client_index)
        elif request_type is EngineCoreRequestType.EXECUTOR_FAILED:
            reason = self.engine_core.executor.failure_reason or "a worker failed"
            raise ExecutorFailedError(f"the executor reported a failure: {reason}")

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
            if self.num_clients > 1:
                self._client_of[request.request_id] = request.client_index
        except ValueError as exc:
            # The client validates first, so this is rare (a LoRA adapter removed by another
            # client meanwhile): finish the request, its sender's stream raises ValueError
            # (InvalidRequestError), keep serving.
            logger.warning("request %r refused: %s", request.request_id, exc)
            refused = EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.ABORT, stop_reason=str(exc),
                error=str(exc), bad_request=True,
            )  # fmt: skip
            self.emit(
                EngineCoreOutputs(outputs=[refused], timestamp=time.monotonic()),
                request.client_index,
            )

    # ---- utility calls -------------------------------------------------------------------

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        method: Callable[..., Any] | None = getattr(self, f"_utility_{call.method}", None)
        hook = self.test_hooks.get(call.method)
        if hook is not None:
            method = functools.partial(hook, self.engine_core)
        if method is None:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=method(*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _utility_check_health(self) -> None:
        self.engine_core.executor.check_health()

    def _utility_statistics(self) -> EngineStats:
        stats = self.engine_core.statistics()
        return msgspec.structs.replace(stats, data_parallel_rank=self.rank)

    def _utility_reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def _utility_pause(self) -> None:
        self.paused = True

    def _utility_resume(self) -> None:
        self.paused = False

    def _utility_sleep(self, level: int) -> None:
        self.engine_core.sleep(level)

    def _utility_wake_up(self) -> None:
        self.engine_core.wake_up()

    def _utility_collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float | None
    ) -> list[Any]:
        return self.engine_core.collective_rpc(method, args, kwargs, timeout)

    def _utility_add_lora(self, name: str, path: str) -> bool:
        return self.engine_core.add_lora(name, path)

    def _utility_remove_lora(self, name: str) -> None:
        self.engine_core.remove_lora(name)

    def _utility_list_loras(self) -> list[tuple[str, str]]:
        return self.engine_core.list_loras()

    def _utility_start_profile(self, profile_dir: str) -> None:
        self.engine_core.start_profile(profile_dir)

    def _utility_stop_profile(self) -> list[str]:
        return self.engine_core.stop_profile()


# ---- the process ------------------------------------------------------------------------------


class EngineCoreProc:
    """The busy loop plus its two IO threads, over ZMQ sockets."""

    def __init__(
        self,
        engine_core: EngineCore,
        ctx: zmq.Context[zmq.Socket[bytes]],
        addresses: Any,
        step_timeout: float,
        rank: int = 0,
    ) -> None:
        self.ctx = ctx
        self.output_queue: queue.Queue[tuple[int | None, EngineCoreOutputs] | object] = (
            queue.Queue()
        )
        self._output_addresses: list[str] = addresses.output_addresses
        self.loop = EngineCoreLoop(
            engine_core,
            lambda outputs, client: self.output_queue.put((client, outputs)),
            num_clients=len(self._output_addresses),
            rank=rank,
        )
        self.rank = rank
        self._stop_input = threading.Event()
        # The input socket is bound here, before READY, so the clients can connect at once.
        self._input_socket = make_socket(ctx, addresses.input_address, zmq.PULL, bind=True)
        # What it bound: a tcp:// address with port `*` (Ray ranks) gets a free port here.
        self.input_address = self._input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.input_thread = threading.Thread(
            target=self._process_input_socket, name="EngineCoreInputIO", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._process_output_socket, name="EngineCoreOutputIO", daemon=True
        )
        self.step_timeout = step_timeout
        self.watchdog_thread = threading.Thread(
            target=self._watch_steps, name="EngineCoreWatchdog", daemon=True
        )

    def run(self) -> None:
        """Serve until shutdown; on a fatal error send ENGINE_CORE_DEAD and re-raise."""
        self.input_thread.start()
        self.output_thread.start()
        self.watchdog_thread.start()
        try:
            self.loop.run_busy_loop()
        except SystemExit:
            raise
        except BaseException as exc:
            logger.exception("engine core failed")
            self.output_queue.put((None, EngineCoreOutputs(engine_dead=describe_exception(exc))))
            raise
        finally:
            self._stop_input.set()
            self.output_queue.put(_SHUTDOWN)
            self.input_thread.join(timeout=5)
            self.output_thread.join(timeout=5)

    def _process_input_socket(self) -> None:
        sock = self._input_socket
        decoder = RequestDecoder()
        try:
            while not self._stop_input.is_set():
                if not sock.poll(_IO_POLL_MS):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    item = decoder.decode([f.buffer for f in frames])
                except MalformedFrameError as exc:
                    logger.warning("dropped a malformed frame on the input socket: %s", exc)
                    continue
                self.loop.input_queue.put(item)
        except zmq.ContextTerminated:
            pass  # the process is going down (a hard exit terminated the context): quietly
        finally:
            sock.close(linger=0)

    def _process_output_socket(self) -> None:
        # One socket per client (index = client_index); each output goes to its own client,
        # heartbeats and ENGINE_CORE_DEAD to all of them.
        socks = [
            make_socket(self.ctx, address, zmq.PUSH, bind=False, linger_ms=_OUTPUT_LINGER_MS)
            for address in self._output_addresses
        ]
        encoder = MsgpackEncoder()
        buffer = bytearray()  # reused: send() copies small messages out of it
        try:
            while True:
                try:
                    item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S)
                except queue.Empty:
                    # A heartbeat, with the load (a busy core's load changes between reports).
                    item = (None, EngineCoreOutputs(timestamp=time.monotonic()))
                if item is _SHUTDOWN:
                    return
                client, outputs = cast("tuple[int | None, EngineCoreOutputs]", item)
                outputs.engine_index = self.rank
                if outputs.load is None and outputs.utility_output is None:
                    outputs.load = self.loop.last_load
                encoder.encode_into(outputs, buffer)
                if client is None:
                    for sock in socks:
                        sock.send(buffer)
                elif 0 <= client < len(socks):
                    socks[client].send(buffer)
                else:
                    logger.warning("dropped outputs for unknown client %d", client)
        except zmq.ContextTerminated:
            pass  # the process is going down (its context terminated first): quietly
        finally:
            for sock in socks:
                sock.close()  # lingers until ENGINE_CORE_DEAD is out, or the linger runs out

    def _watch_steps(self) -> None:
        """End the process when a step runs past step_timeout (a hung kernel or collective:
        the busy loop's thread cannot be interrupted, so the process goes, loudly)."""
        reason = self.loop.watch_steps(self.step_timeout, self._stop_input)
        if reason is not None:
            logger.error("%s; exiting", reason)
            self.output_queue.put((None, EngineCoreOutputs(engine_dead=reason)))
            self.output_queue.put(_SHUTDOWN)
            self._stop_input.set()
            self.output_thread.join(timeout=2.0)
            self.input_thread.join(timeout=1.0)
            # ENGINE_CORE_DEAD is out only once the context has flushed the output socket
            # (its linger): terminate it, but never wait on the stuck loop for long.
            flusher = threading.Thread(target=self.ctx.term, daemon=True)
            flusher.start()
            flusher.join(timeout=2.0)
            # The workers see this process's end (their stdin closes) and exit too.
            hard_exit(1)


def main() -> None:
    """`python -m asyncengine.core.engine_core_proc`: the launch arguments from stdin, then
    the engine core until it is told to stop."""
    launch = launch_decoder.decode(read_payload())
    run_engine_core(launch.config, launch.handshake_address, ignore_sigint=launch.ignore_sigint)


def run_engine_core(
    config: EngineConfig, handshake_address: str, *, ignore_sigint: bool = False
) -> None:
    """The engine-core process's body (never returns: it exits).

    1. signals and the parent watch, 2. HELLO, 3. import the model code, 4. the client's
    addresses (with a timeout), 5. build the EngineCore (READY, or FAILED with the root cause),
    6. serve until told to stop. Exits 0 on a clean shutdown, non-zero after a failure.
    """
    install_signal_handlers(ignore_sigint=ignore_sigint)
    setup_logging("engine core")
    _start_parent_watch()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    handshake = make_socket(ctx, handshake_address, zmq.DEALER, bind=False, linger_ms=2000)
    encoder = MsgpackEncoder()
    engine_core: EngineCore | None = None
    exit_code = 0
    try:
        handshake.send(encoder.encode(HandshakeHello(pid=os.getpid())))
        try:
            # The imports (most of the start-up) come before the addresses: the client loads
            # its tokenizer meanwhile and answers HELLO afterwards.
            _prepare_process(config)
            addresses = _receive_addresses(handshake)
            engine_core = _build_engine_core(config)
            proc = EngineCoreProc(
                engine_core,
                ctx,
                addresses,
                config.step_timeout,
                rank=config.parallel_config.data_parallel_rank,
            )
        except Exception as exc:
            reason = describe_exception(exc)
            # The client raises it (EngineStartupError, with this reason): a log line here
            # would say it twice. A debug log has the traceback.
            logger.debug("engine core failed to start: %s", reason, exc_info=True)
            handshake.send(encoder.encode(HandshakeFailed(error=reason)))
            exit_code = 1
            return
        ready = HandshakeReady(engine_core.num_kv_blocks, input_address=proc.input_address)
        handshake.send(encoder.encode(ready))
        handshake.close()
        proc.run()
    except SystemExit as exc:
        logger.info("engine core shutting down (%s)", exc)
    except BaseException:
        exit_code = 1
    finally:
        # This is the shutdown a SIGTERM asks for: another one (the client stops a core that
        # failed to start as soon as it says so) must not cut it short and skip hard_exit.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if engine_core is not None:
            engine_core.shutdown()
        handshake.close()
        ctx.term()
    # Everything is shut down explicitly above; skip the interpreter's slow teardown of torch
    # (about a second), so that a shutdown takes milliseconds.
    hard_exit(exit_code)


def _receive_addresses(handshake: zmq.Socket[bytes]) -> HandshakeAddresses:
    if not handshake.poll(int(HANDSHAKE_TIMEOUT_S * 1000)):
        raise TimeoutError(f"the client sent no addresses within {HANDSHAKE_TIMEOUT_S} s")
    message = handshake_decoder.decode(handshake.recv())
    if not isinstance(message, HandshakeAddresses):
        raise TypeError(f"expected HandshakeAddresses, got {type(message).__name__}")
    return message


def _prepare_process(config: EngineConfig) -> None:
    """Take this rank's GPUs, then import the model code (this process is the engine's own)."""
    from asyncengine.core.engine_core import import_model_code
    from asyncengine.executor.placement import claim_rank_gpus

    # Before anything starts CUDA: this core and its workers see only this rank's GPUs.
    claim_rank_gpus(config.parallel_config, config.device_config.device)
    skip_unused_packages(config.model_config)
    import_model_code(config, owns_process=True)


def _build_engine_core(config: EngineConfig) -> EngineCore:
    from asyncengine.core.engine_core import EngineCore

    return EngineCore(config)


def _start_parent_watch() -> None:
    """Exit when the parent dies: no orphaned engine cores."""

    def on_death() -> None:
        logger.warning("the engine core's parent process died: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)  # a clean shutdown in the main thread...
        time.sleep(10.0)
        os._exit(1)  # ...or, if it hangs, none

    start_parent_watch(on_death, "EngineCoreParentWatch")


if __name__ == "__main__":
    main()
