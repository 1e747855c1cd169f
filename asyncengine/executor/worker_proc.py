"""The body of one tensor-parallel worker process, started by MultiprocExecutor.

The process is `python -m asyncengine.executor.worker_proc` (a `ChildProcess`, its launch
arguments on stdin): a fresh interpreter that never imports the application's `__main__`.

1. signals, the parent watch and a log prefix naming the rank and pid;
2. connect to the executor, say WorkerHello;
3. on InitDistributed: join the process group, load and shard the model, say WorkerReady;
4. serve ExecuteModel and RpcCall messages until Shutdown, answering each failure with its
   traceback text (the executor raises it in the caller).
"""

from __future__ import annotations

import functools
import logging
import os
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from asyncengine.child_process import read_payload
from asyncengine.heap import IDLE_RELEASE_S, release_free_heap
from asyncengine.ipc.sockets import make_socket
from asyncengine.ipc.worker_messages import (
    ExecuteModel,
    ExecuteResult,
    InitDistributed,
    RpcCall,
    RpcResult,
    Shutdown,
    WorkerFailure,
    WorkerHello,
    WorkerLaunch,
    WorkerReady,
    to_worker_decoder,
    worker_launch_decoder,
)
from asyncengine.process_setup import (
    hard_exit,
    install_signal_handlers,
    load_test_hooks,
    skip_unused_packages,
    start_parent_watch,
)

if TYPE_CHECKING:
    from asyncengine.worker.worker import Worker

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "ASYNCENGINE_WORKER_LOG_LEVEL"
_STARTUP_TIMEOUT_S = 120.0  # waiting for InitDistributed


def main() -> None:
    """`python -m asyncengine.executor.worker_proc`: the launch arguments from stdin, then
    the worker until Shutdown."""
    run_worker(worker_launch_decoder.decode(read_payload()))


def run_worker(launch: WorkerLaunch) -> None:
    """The worker process's body; exits 0 after Shutdown, 1 after a failure."""
    rank = launch.rank
    _setup_logging(rank)
    # Ctrl-C reaches the engine core too, which stops its workers in order.
    install_signal_handlers(ignore_sigint=True)
    _start_parent_watch(rank)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    inbox = make_socket(ctx, launch.to_worker, zmq.PULL, bind=False)
    outbox = make_socket(ctx, launch.from_worker, zmq.PUSH, bind=False, linger_ms=2000)
    encoder = msgspec.msgpack.Encoder()
    exit_code = 0
    try:
        worker = _start(launch, inbox, outbox, encoder)
        _serve(worker, rank, inbox, outbox, encoder)
    except SystemExit as exc:
        logger.info("worker shutting down (%s)", exc)
    except BaseException as exc:
        logger.error("worker failed: %s", exc)
        outbox.send(encoder.encode(_failure(rank, -1, exc)))
        exit_code = 1
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
    # The process group's teardown can block on dead peers; everything of ours is closed.
    hard_exit(exit_code)


def _start(
    launch: WorkerLaunch,
    inbox: zmq.Socket[bytes],
    outbox: zmq.Socket[bytes],
    encoder: msgspec.msgpack.Encoder,
) -> Worker:
    rank, world_size, config = launch.rank, launch.world_size, launch.config
    skip_unused_packages(config.model_config)
    from asyncengine.model.loader import import_model_code

    # A worker process is the engine's own, like the core's: see import_model_code.
    # The same choice load_model_forward makes: only a sharded model needs transformers.
    import_model_code(config.model_config, freeze=True, tensor_parallel=world_size > 1)

    import torch

    from asyncengine.executor.placement import worker_device
    from asyncengine.worker.extension import with_extension
    from asyncengine.worker.parallel import create_store, join_group
    from asyncengine.worker.worker import Worker

    # Each worker (of every data-parallel rank here) gets its share of the cores; more
    # threads than cores only contend.
    torch.set_num_threads(config.parallel_config.threads_per_worker())
    outbox.send(encoder.encode(WorkerHello(rank, os.getpid())))
    if not inbox.poll(int(_STARTUP_TIMEOUT_S * 1000)):
        raise TimeoutError(f"no InitDistributed from the executor in {_STARTUP_TIMEOUT_S} s")
    init = to_worker_decoder.decode(inbox.recv())
    if isinstance(init, Shutdown):
        raise SystemExit("shut down during startup")
    if not isinstance(init, InitDistributed):
        raise TypeError(f"expected InitDistributed, got {type(init).__name__}")
    # A file in the executor's private (0700) directory: no socket, on any interface.
    store = create_store(world_size, launch.store_path)
    # cuda:rank of the GPUs this rank's core sees: its own (executor/placement.py).
    device = worker_device(config.device_config.device, rank)
    tp = join_group(rank, world_size, store, device)
    # With a worker_extension_cls, its methods mixed in (collective_rpc calls them).
    worker_cls = with_extension(Worker, config.parallel_config.worker_extension_cls)
    worker: Worker = worker_cls(
        config.model_config,
        config.cache_config,
        config.device_config,
        tp,
        device,
        scheduler_config=config.scheduler_config,
    )
    worker.load_model()
    outbox.send(encoder.encode(WorkerReady(rank)))
    return worker


def _serve(
    worker: Worker,
    rank: int,
    inbox: zmq.Socket[bytes],
    outbox: zmq.Socket[bytes],
    encoder: msgspec.msgpack.Encoder,
    idle_release_s: float = IDLE_RELEASE_S,
    release_heap: Callable[[], None] = release_free_heap,
) -> None:
    # testing_* methods (fault injection), only where a test asked for them.
    test_hooks = load_test_hooks("WORKER_HOOKS")
    buffer = bytearray()  # reused for every reply
    stepped = False  # a step ran since the heap was last released
    while True:
        if stepped and not inbox.poll(int(idle_release_s * 1000)):
            release_heap()  # idle after steps: their freed buffers go back (heap.py)
            stepped = False
        message = to_worker_decoder.decode(inbox.recv(copy=False).buffer)
        reply: Any
        if isinstance(message, ExecuteModel):
            stepped = True
            try:
                output = worker.execute_model(message.scheduler_output)
            except Exception as exc:
                reply = _failure(rank, message.step_id, exc)
            else:
                if rank != 0:
                    continue  # only the driver's output is used
                reply = ExecuteResult(rank, message.step_id, output)
        elif isinstance(message, RpcCall):
            reply = _rpc(worker, rank, message, test_hooks)
        elif isinstance(message, Shutdown):
            return
        else:
            logger.warning("ignoring unexpected %s", type(message).__name__)
            continue
        encoder.encode_into(reply, buffer)
        outbox.send(buffer)


def _rpc(
    worker: Worker, rank: int, call: RpcCall, test_hooks: dict[str, Callable[..., Any]]
) -> RpcResult | WorkerFailure:
    method: Callable[..., Any] | None = None
    hook = test_hooks.get(call.method)
    if hook is not None:
        method = functools.partial(hook, worker)
    elif not call.method.startswith("_"):
        method = getattr(worker, call.method, None)
    if method is None:
        exc = AttributeError(f"the worker has no method {call.method!r}")
        return _failure(rank, call.call_id, exc)
    try:
        return RpcResult(rank, call.call_id, method(*call.args, **call.kwargs))
    except Exception as exc:
        return _failure(rank, call.call_id, exc)


def _failure(rank: int, call_id: int, exc: BaseException) -> WorkerFailure:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return WorkerFailure(rank, call_id, f"{type(exc).__name__}: {exc}", text)


def _setup_logging(rank: int) -> None:
    """Every log line of this process says which rank and pid it comes from."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(
            f"(worker rank={rank} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get(LOG_LEVEL_ENV, "WARNING").upper())


def _start_parent_watch(rank: int) -> None:
    """Exit at once when the engine core (our parent) dies: no orphaned workers."""

    def on_death() -> None:
        logger.warning("worker rank %d: the engine core died; exiting", rank)
        os._exit(1)  # a worker holds nothing that needs a clean shutdown

    start_parent_watch(on_death, f"WorkerParentWatch-{rank}")


if __name__ == "__main__":
    main()
