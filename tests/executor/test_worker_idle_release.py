"""A tensor-parallel worker hands its freed heap back once it has been idle after steps."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from asyncengine.executor.worker_proc import _serve
from asyncengine.ipc.scheduler_output import EMPTY_MODEL_RUNNER_OUTPUT, SchedulerOutput
from asyncengine.ipc.worker_messages import ExecuteModel, ExecuteResult, Shutdown

pytestmark = pytest.mark.timeout(30)


def test_a_worker_releases_the_heap_once_when_idle_after_steps() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    to_worker, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox, from_worker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_worker.bind("inproc://to-worker")
    inbox.connect("inproc://to-worker")
    outbox.bind("inproc://from-worker")
    from_worker.connect("inproc://from-worker")
    released: list[float] = []
    worker = SimpleNamespace(execute_model=lambda scheduler_output: EMPTY_MODEL_RUNNER_OUTPUT)
    encoder = msgspec.msgpack.Encoder()
    serve = threading.Thread(
        target=_serve,
        args=(worker, 0, inbox, outbox, encoder, 0.05, lambda: released.append(time.monotonic())),
    )
    serve.start()
    try:
        time.sleep(0.15)
        assert released == []  # no step yet: nothing to release

        def step(step_id: int) -> None:
            to_worker.send(
                encoder.encode(ExecuteModel(step_id, SchedulerOutput([], [], {}, 0, [])))
            )
            reply = msgspec.msgpack.decode(from_worker.recv(), type=ExecuteResult)
            assert reply.step_id == step_id

        for step_id in range(3):  # back to back: no release between them
            step(step_id)
        assert released == []
        deadline = time.monotonic() + 5
        while not released:
            assert time.monotonic() < deadline, "the idle worker never released its heap"
            time.sleep(0.01)
        time.sleep(0.15)
        assert len(released) == 1  # once per idle period
        step(3)
        deadline = time.monotonic() + 5
        while len(released) < 2:
            assert time.monotonic() < deadline, "no release after the next idle period"
            time.sleep(0.01)
    finally:
        to_worker.send(encoder.encode(Shutdown()))
        serve.join(timeout=5)
        for sock in (to_worker, inbox, outbox, from_worker):
            sock.close(linger=0)
        ctx.term()
    assert not serve.is_alive()
