"""The engine core's busy loop and IO threads, driven over real ZMQ sockets with a fake core.

The fake EngineCore produces one token per live request per step, so these tests check the
loop's plumbing (requests in, outputs out, utilities, malformed frames, failures) in
milliseconds; tests/client runs the same code with a real model in a spawned process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from asyncengine import SamplingParams
from asyncengine.core.engine_core_proc import (
    EngineCoreLoop,
    EngineCoreProc,
    ExecutorFailedError,
)
from asyncengine.ipc.messages import (
    CoreLoad,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    FinishReason,
    HandshakeAddresses,
    UtilityCall,
)
from asyncengine.ipc.serial import MsgpackEncoder, encode_request, outputs_decoder
from asyncengine.ipc.sockets import (
    ipc_address,
    make_private_socket_dir,
    make_socket,
    remove_socket_dir,
)
from asyncengine.testing import fault_injection


class FakeExecutor:
    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.healthy = True
        self.failure_reason: str | None = None

    def register_failure_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def _notify_failure(self, reason: str = "worker 1 died") -> None:
        self.failure_reason = reason
        for callback in self.callbacks:
            callback()

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("worker 0 is unhealthy")

    def execute_model(self, *args: Any) -> None:
        return None


class FakeEngineCore:
    """One token (the request's step count) per live request per step."""

    def __init__(self) -> None:
        self.executor = FakeExecutor()
        self.remaining: dict[str, int] = {}
        self.scheduler = SimpleNamespace(has_requests=lambda: bool(self.remaining))
        self.steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.remaining:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.remaining[request.request_id] = request.sampling_params.max_tokens or 1

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            self.remaining.pop(req_id, None)

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        self.executor.execute_model()
        outputs = []
        for req_id in list(self.remaining):
            self.remaining[req_id] -= 1
            done = self.remaining[req_id] == 0
            outputs.append(
                EngineCoreOutput(
                    req_id, [self.steps], finish_reason=FinishReason.LENGTH if done else None
                )
            )
            if done:
                del self.remaining[req_id]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def statistics(self) -> EngineStats:
        return EngineStats(
            num_running_reqs=len(self.remaining),
            num_waiting_reqs=0,
            num_preemptions=0,
            num_kv_blocks=8,
            num_free_kv_blocks=8 - len(self.remaining),
            kv_cache_usage=len(self.remaining) / 8,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )

    def reset_prefix_cache(self) -> bool:
        return True

    def load(self) -> CoreLoad:
        return CoreLoad(0, len(self.remaining), len(self.remaining) / 8)


def _request(req_id: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, [1, 2], SamplingParams(max_tokens=max_tokens), 0.0)


class LoopHarness:
    """An EngineCoreLoop running in a thread, collecting what it emits."""

    def __init__(self) -> None:
        self.core = FakeEngineCore()
        self.emitted: list[EngineCoreOutputs] = []
        self.loop = EngineCoreLoop(
            self.core,  # type: ignore[arg-type]
            lambda outputs, client: self.emitted.append(outputs),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_busy_loop()
        except BaseException as exc:
            self.error = exc

    def put(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self.loop.input_queue.put((request_type, payload))

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.emitted for r in o.outputs if r.request_id == req_id
                for t in r.new_token_ids]  # fmt: skip

    def utility_results(self) -> dict[int, Any]:
        return {
            o.utility_output.call_id: o.utility_output for o in self.emitted if o.utility_output
        }


@pytest.fixture
def harness() -> Iterator[LoopHarness]:
    h = LoopHarness()
    yield h
    h.loop.shutdown_nowait()
    h.thread.join(timeout=5)
    assert not h.thread.is_alive()


def test_loop_runs_requests_to_completion_and_idles(harness: LoopHarness) -> None:
    harness.put(EngineCoreRequestType.ADD, _request("a", 3))
    harness.put(EngineCoreRequestType.ADD, _request("b", 5))
    harness.wait_for(lambda: len(harness.tokens("b")) == 5)
    assert len(harness.tokens("a")) == 3
    steps = harness.core.steps
    time.sleep(0.05)
    assert harness.core.steps == steps  # idle: blocked on the input queue, not spinning


def test_an_idle_core_releases_the_heap_once_after_its_steps(harness: LoopHarness) -> None:
    released: list[float] = []
    harness.loop.idle_release_s = 0.05  # the loop reads it only after a step
    harness.loop.release_heap = lambda: released.append(time.monotonic())
    time.sleep(0.15)
    assert released == []  # idle since start: nothing freed to release
    harness.put(EngineCoreRequestType.ADD, _request("long", 10_000_000))
    harness.wait_for(lambda: len(harness.tokens("long")) > 3)
    time.sleep(0.15)
    assert released == []  # busy: never waiting on the queue
    harness.put(EngineCoreRequestType.ABORT, ["long"])
    harness.wait_for(lambda: len(released) == 1)
    time.sleep(0.15)
    assert len(released) == 1  # once per idle period, not every timeout
    harness.put(EngineCoreRequestType.ADD, _request("b", 2))
    harness.wait_for(lambda: len(released) == 2)
    assert len(harness.tokens("b")) == 2


def test_abort_stops_a_request(harness: LoopHarness) -> None:
    harness.put(EngineCoreRequestType.ADD, _request("long", 10_000_000))
    harness.wait_for(lambda: len(harness.tokens("long")) > 3)
    harness.put(EngineCoreRequestType.ABORT, ["long"])
    harness.wait_for(lambda: not harness.core.remaining)


def test_refused_request_is_finished_and_the_loop_goes_on(harness: LoopHarness) -> None:
    harness.put(EngineCoreRequestType.ADD, _request("dup", 10_000_000))
    harness.put(EngineCoreRequestType.ADD, _request("dup", 1))
    harness.wait_for(
        lambda: any(
            r.finish_reason == FinishReason.ABORT and "already in use" in str(r.stop_reason)
            for o in harness.emitted
            for r in o.outputs
        )
    )
    harness.put(EngineCoreRequestType.ADD, _request("ok", 2))
    harness.wait_for(lambda: len(harness.tokens("ok")) == 2)


def test_utility_calls_answer_with_result_or_error(harness: LoopHarness) -> None:
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(1, "check_health"))
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(2, "statistics"))
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(3, "no_such_method"))
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(4, "testing_fail_next_step"))
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(5, "__init__"))
    harness.wait_for(lambda: len(harness.utility_results()) == 5)
    results = harness.utility_results()
    assert results[1].error is None and results[1].result is None
    stats = msgspec.convert(msgspec.to_builtins(results[2].result), EngineStats)
    assert stats.num_kv_blocks == 8 and stats.num_free_kv_blocks == 8
    assert "unknown utility method" in (results[3].error or "")
    # Fault injection is refused unless the test-hooks variable is set.
    assert "unknown utility method" in (results[4].error or "")
    assert "unknown utility method" in (results[5].error or "")
    harness.core.executor.healthy = False
    harness.put(EngineCoreRequestType.UTILITY, UtilityCall(6, "check_health"))
    harness.wait_for(lambda: 6 in harness.utility_results())
    assert "unhealthy" in (harness.utility_results()[6].error or "")


def test_executor_failure_callback_stops_the_loop() -> None:
    h = LoopHarness()
    h.core.executor._notify_failure()
    h.thread.join(timeout=5)
    assert isinstance(h.error, ExecutorFailedError)


def test_injected_model_runner_failure_raises_from_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    h = LoopHarness()
    h.put(EngineCoreRequestType.UTILITY, UtilityCall(1, "testing_fail_next_step"))
    h.put(EngineCoreRequestType.ADD, _request("a", 5))
    h.thread.join(timeout=5)
    assert isinstance(h.error, RuntimeError) and "injected" in str(h.error)


# ---- EngineCoreProc: the IO threads over real sockets -----------------------------------------


class ProcHarness:
    def __init__(self, tmp: Path) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        addresses = HandshakeAddresses(ipc_address(tmp, "input"), [ipc_address(tmp, "output")])
        self.output = make_socket(self.ctx, addresses.output_addresses[0], zmq.PULL, bind=True)
        self.core = FakeEngineCore()
        self.proc = EngineCoreProc(self.core, self.ctx, addresses, 300.0)  # type: ignore[arg-type]
        self.input = make_socket(self.ctx, addresses.input_address, zmq.PUSH, bind=False)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run()
        except BaseException as exc:
            self.error = exc

    def recv(self, timeout_s: float = 5.0) -> EngineCoreOutputs:
        assert self.output.poll(int(timeout_s * 1000)), "no output from the core"
        return outputs_decoder.decode(self.output.recv())

    def close(self) -> None:
        self.proc.loop.shutdown_nowait()
        self.thread.join(timeout=5)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()


@pytest.fixture
def proc_harness() -> Iterator[ProcHarness]:
    tmp = make_private_socket_dir()
    h = ProcHarness(tmp)
    yield h
    h.close()
    remove_socket_dir(tmp)


def test_malformed_frames_are_logged_and_dropped(
    proc_harness: ProcHarness, caplog: pytest.LogCaptureFixture
) -> None:
    enc = MsgpackEncoder()
    garbage = [
        [b"\x07", b"xx"],
        [b"\x00", b"\xc1garbage"],
        [b"\x00"],
        [b"\x01", enc.encode([1, 2, 3])],
        [EngineCoreRequestType.EXECUTOR_FAILED.value, b""],
        [b"\x02", b"\x80\x81\x82", b"extra"],
    ]
    with caplog.at_level(logging.WARNING, logger="asyncengine.core.engine_core_proc"):
        for frames in garbage:
            proc_harness.input.send_multipart(frames)
        # A good request after the garbage is served: the core kept going.
        proc_harness.input.send_multipart(
            encode_request(enc, EngineCoreRequestType.ADD, _request("good", 2))
        )
        tokens: list[int] = []
        while len(tokens) < 2:
            for out in proc_harness.recv().outputs:
                tokens += out.new_token_ids
    dropped = [r for r in caplog.records if "malformed frame" in r.getMessage()]
    assert len(dropped) == len(garbage)
    assert proc_harness.thread.is_alive() and proc_harness.error is None


def test_engine_core_dead_is_sent_when_the_executor_fails(proc_harness: ProcHarness) -> None:
    proc_harness.core.executor._notify_failure()
    out = proc_harness.recv()
    assert out.engine_dead is not None and "executor reported a failure" in out.engine_dead
    proc_harness.thread.join(timeout=5)
    assert isinstance(proc_harness.error, ExecutorFailedError)


def test_utility_round_trip_over_the_sockets(proc_harness: ProcHarness) -> None:
    enc = MsgpackEncoder()
    proc_harness.input.send_multipart(
        encode_request(enc, EngineCoreRequestType.UTILITY, UtilityCall(9, "statistics"))
    )
    out = proc_harness.recv()
    assert out.utility_output is not None and out.utility_output.call_id == 9
    stats = msgspec.convert(out.utility_output.result, EngineStats)
    assert stats.num_kv_blocks == 8


def test_a_terminated_context_ends_the_io_threads_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 22 item 11: the process terminates its ZMQ context (a shutdown racing a worker
    death) while both IO threads still run: they end without a traceback, and the executor's
    failure is still handled."""
    crashes: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    tmp = make_private_socket_dir()
    h = ProcHarness(tmp)
    try:
        h.recv()  # a heartbeat: both IO threads are running
        h.input.close(linger=0)
        h.output.close(linger=0)
        terminator = threading.Thread(target=h.ctx.term, daemon=True)
        terminator.start()  # returns once every socket, the IO threads' too, is closed
        terminator.join(timeout=5)
        assert not terminator.is_alive(), "an IO thread kept its socket open"
        assert not h.proc.input_thread.is_alive() and not h.proc.output_thread.is_alive()
        h.core.executor._notify_failure()  # the worker death the shutdown raced
        h.thread.join(timeout=5)
        assert isinstance(h.error, ExecutorFailedError)
    finally:
        remove_socket_dir(tmp)
    assert crashes == []
