"""Messages between the MultiprocExecutor and its worker processes (msgspec msgpack over ZMQ).

executor → worker (one PUSH socket per worker):  InitDistributed, ExecuteModel, RpcCall, Shutdown
worker → executor (one shared PULL socket):       WorkerHello, WorkerReady, ExecuteResult,
                                                  RpcResult, WorkerFailure

Every message is a tagged msgspec Struct decoded with a typed decoder: no pickle, and the
scheduler output of a step is encoded once and sent to every rank as the same bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.ipc.scheduler_output import ModelRunnerOutput, SchedulerOutput


class WorkerLaunch(msgspec.Struct, gc=False):
    """Executor → worker process, on its stdin at start: who it is and where to talk."""

    rank: int
    world_size: int
    config: EngineConfig
    to_worker: str  # the address of its inbox (executor → worker)
    from_worker: str  # the address of the executor's results socket
    store_path: str  # the rendezvous FileStore, in the executor's private socket directory


worker_launch_decoder: msgspec.msgpack.Decoder[WorkerLaunch] = msgspec.msgpack.Decoder(WorkerLaunch)


class InitDistributed(msgspec.Struct, tag=True, array_like=True):
    """Every rank has said hello: join the process group (through the launch's FileStore),
    then load and shard the model."""


class ExecuteModel(msgspec.Struct, tag=True, array_like=True, gc=False):
    step_id: int
    scheduler_output: SchedulerOutput


class RpcCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToWorker = InitDistributed | ExecuteModel | RpcCall | Shutdown


class WorkerHello(msgspec.Struct, tag=True, array_like=True):
    """Sent once the worker's sockets are up."""

    rank: int
    pid: int


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    """The process group is joined and the model is loaded (and sharded)."""

    rank: int


class ExecuteResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Rank 0's output of a step (the other ranks answer a step only when it fails)."""

    rank: int
    step_id: int
    output: ModelRunnerOutput


class RpcResult(msgspec.Struct, tag=True, array_like=True):
    rank: int
    call_id: int
    result: Any


class WorkerFailure(msgspec.Struct, tag=True, array_like=True):
    """A call raised in the worker: its message and traceback text, for the caller."""

    rank: int
    call_id: int  # the RpcCall's call_id, the ExecuteModel's step_id, or -1 during startup
    error: str
    traceback: str


FromWorker = WorkerHello | WorkerReady | ExecuteResult | RpcResult | WorkerFailure

to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
