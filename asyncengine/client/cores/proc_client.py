"""ProcCoreClient: AsyncLLM's end of N >= 1 engine cores (data-parallel ranks), over ZMQ.

Each rank is a full engine core (its own scheduler, KV cache and executor) behind a
CoreHandle: a process of this one's (the default), a Ray actor's (`data_parallel_backend=
"ray"`), or one another process started (AttachedCores: the API server processes). Every
rank connects to this client's one output socket; each has its own input socket. Sockets are
driven from the event loop without zmq.asyncio, so every anyio backend works: sends use
NOBLOCK (a connecting PUSH socket queues, never blocks), and receives await
`anyio.wait_readable` on the socket's edge-triggered FD.

A rank is dead when its process exits, when it reports ENGINE_CORE_DEAD, or when it has been
silent past step_timeout (stopped or hung: it is killed). What a death means, and where each
message goes, is the RankBook's: with one core, the engine is dead; with several, see
dp_ranks.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.client.cores.client import MAX_OUTPUTS_PER_BATCH, EngineCoreClient, RankDied
from asyncengine.client.cores.handle import CoreBackend, CoreHandle
from asyncengine.client.cores.handshake import readable, socket_fd
from asyncengine.client.cores.launch import launch_cores, start_cores, stop_cores
from asyncengine.client.cores.process import CoreProcess, ProcessBackend
from asyncengine.client.cores.ranks import RankBook, SingleRank
from asyncengine.config import EngineConfig
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
    make_private_socket_dir,
    make_socket,
    remove_socket_dir,
    sweep_stale_socket_dirs,
)

logger = logging.getLogger(__name__)

# A dead process's own ENGINE_CORE_DEAD (it says why) may still be on its way: wait this long
# before reporting the death from its exit status.
_DEATH_REPORT_GRACE_S = 0.3


class ProcCoreClient(EngineCoreClient):
    """The cores of `backend` (by default: processes of this one's, or Ray actors' with
    `data_parallel_backend="ray"`), one per rank; this is client `client_index` of them
    (API server processes are several clients of the same cores)."""

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout: float,
        *,
        backend: CoreBackend | None = None,
        client_index: int = 0,
    ) -> None:
        self.config = config
        self.client_index = client_index
        self._startup_timeout = startup_timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket_dir = make_private_socket_dir()
        self.backend = backend or default_backend(config, self._ctx, self._socket_dir)
        self.cores: list[CoreHandle] = []  # one per rank, once launched
        self._ranks: RankBook = SingleRank()  # the rank count's own, once launched
        self._output_address = ""
        self._output: zmq.Socket[bytes] | None = None
        self._inputs: list[zmq.Socket[bytes] | None] = []
        # Deaths this client finds itself (an exit, silence) join the cores' own messages.
        self._self_report: zmq.Socket[bytes] | None = None
        self._encoder = MsgpackEncoder()
        self._last_heard: list[float] = []  # per rank: any message, heartbeats included
        self._engine_dead_event = anyio.Event()
        self._shut_down = False

    @property
    def data_parallel_size(self) -> int:
        return len(self.cores)

    @property
    def socket_dir(self) -> Path:
        return self._socket_dir

    @property
    def proc(self) -> ChildProcess | None:
        """Rank 0's process, where it is a child of this one (tests and benchmarks watch it)."""
        core = self.cores[0] if self.cores else None
        return core.proc if isinstance(core, CoreProcess) else None

    def rank_errors(self) -> dict[int, str]:
        return self._ranks.rank_errors()

    # ---- start-up ------------------------------------------------------------------------

    async def launch(self) -> None:
        try:
            await self._launch()
        except BaseException:
            await self.shutdown()
            raise

    async def _launch(self) -> None:
        if self._output is None:
            await self.backend.open(self._startup_timeout)
            self._output = make_socket(
                self._ctx, self.backend.output_address(), zmq.PULL, bind=True
            )
            # With tcp://host:* the socket picked a free port.
            self._output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
            self._self_report = make_socket(self._ctx, self._output_address, zmq.PUSH, bind=False)
        if not self.cores:
            self.cores = await launch_cores(
                self.config, self.backend, startup_timeout=self._startup_timeout
            )
            self._ranks = rank_book(self.config, len(self.cores))
            self._last_heard = [time.monotonic()] * len(self.cores)

    async def start(self) -> None:
        """Every rank starts at once; the first that fails stops them all (its name and root
        cause in the EngineStartupError)."""
        try:
            await self._launch()
            await start_cores(self.cores, [self._output_address])
            self.num_kv_blocks = sum(core.num_kv_blocks for core in self.cores)
            self._inputs = [
                make_socket(self._ctx, core.input_address, zmq.PUSH, bind=False)
                for core in self.cores
            ]
        except BaseException:
            await self.shutdown()
            raise

    # ---- requests ------------------------------------------------------------------------

    def _send(
        self, rank: int, request_type: EngineCoreRequestType, payload: RequestPayload
    ) -> None:
        if rank >= len(self._inputs) or not self._ranks.is_live(rank):
            return  # shut down, or a dead rank: nothing to send to
        sock = self._inputs[rank]
        if sock is not None:
            # A connecting PUSH socket with no high-water mark queues: NOBLOCK never fails.
            sock.send_multipart(encode_request(self._encoder, request_type, payload), zmq.NOBLOCK)

    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        rank = self._ranks.route(request, data_parallel_rank)
        request.client_index = self.client_index
        self._send(rank, EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        for rank, ids in self._ranks.abort(request_ids).items():
            self._send(rank, EngineCoreRequestType.ABORT, ids)

    def call_utility_nowait(self, call: UtilityCall) -> None:
        call.client_index = self.client_index
        for rank in self._ranks.call(call):
            self._send(rank, EngineCoreRequestType.UTILITY, call)

    # ---- outputs -------------------------------------------------------------------------

    async def get_outputs(self) -> list[EngineCoreOutputs | RankDied]:
        sock = self._output
        assert sock is not None
        while True:
            frames = await recv_frames(sock)
            now = time.monotonic()
            batch: list[EngineCoreOutputs | RankDied] = []
            for outputs in decode_outputs(frames):
                rank = outputs.engine_index
                if not 0 <= rank < len(self.cores) or not self._ranks.is_live(rank):
                    continue  # a dead rank's last words (or a stray frame): accounted for
                if outputs.engine_dead is None:
                    self._last_heard[rank] = now
                batch.extend(self._ranks.take(rank, outputs))
            if self._ranks.engine_dead is not None:
                self._engine_dead_event.set()
            if batch:
                return batch

    def silent_for(self) -> float:
        now = time.monotonic()
        return max(
            (now - heard for r, heard in enumerate(self._last_heard) if self._ranks.is_live(r)),
            default=0.0,
        )

    # ---- deaths --------------------------------------------------------------------------

    async def wait_dead(self) -> str:
        self._last_heard = [time.monotonic()] * len(self.cores)  # serving starts now
        async with anyio.create_task_group() as tg:
            for rank in range(len(self.cores)):
                tg.start_soon(self._watch_rank, rank)
            await self._engine_dead_event.wait()
            tg.cancel_scope.cancel()
        assert self._ranks.engine_dead is not None
        return self._ranks.engine_dead

    async def _watch_rank(self, rank: int) -> None:
        """Report the rank's death among the outputs, once: its exit, or silence past
        step_timeout (then it is killed)."""
        core, limit = self.cores[rank], self.config.step_timeout
        while not await core.wait_exit():
            if not self._ranks.is_live(rank):
                return
            silent = time.monotonic() - self._last_heard[rank]
            if silent > limit:
                # Stopped (SIGSTOP) or hung beyond its own watchdog: it will never answer.
                await core.stop(kill=True)
                self._report_death(
                    rank,
                    f"{core.name} process (pid {core.pid}) sent nothing for {silent:.1f} s, "
                    f"past step_timeout={limit:g} s: it was stopped or hung, and is killed",
                )
                return
        await anyio.sleep(_DEATH_REPORT_GRACE_S)
        self._report_death(rank, f"{core.name} process (pid {core.pid}) died: {core.exit_desc()}")

    def _report_death(self, rank: int, reason: str) -> None:
        sock = self._self_report
        if sock is None or not self._ranks.is_live(rank):
            return
        message = EngineCoreOutputs(engine_dead=reason, engine_index=rank)
        sock.send(self._encoder.encode(message), zmq.NOBLOCK)

    # ---- shutdown ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        with anyio.CancelScope(shield=True):
            for sock in self._inputs:
                if sock is not None:
                    sock.close(linger=0)
            self._inputs = []
            await stop_cores(self.cores)
            await self.backend.close()
            for sock in (self._output, self._self_report):
                if sock is not None:
                    sock.close(linger=0)
            self._output = self._self_report = None
            self._ctx.term()
            remove_socket_dir(self._socket_dir)
            # A core killed before its own clean-up leaves its executor's directory: the
            # core is gone now, so the sweep takes it.
            sweep_stale_socket_dirs()


def default_backend(
    config: EngineConfig, ctx: zmq.Context[zmq.Socket[bytes]], socket_dir: Path
) -> CoreBackend:
    """Where `data_parallel_backend` says the cores run: processes of this one's, or Ray's."""
    if config.parallel_config.data_parallel_backend == "ray":
        from asyncengine.client.cores.ray_core import RayBackend

        return RayBackend(config, ctx)
    return ProcessBackend(ctx, socket_dir)


def rank_book(config: EngineConfig, size: int) -> RankBook:
    """The book for `size` ranks: data-parallel book-keeping only where there are several."""
    if size == 1:
        return SingleRank()
    from asyncengine.client.cores.dp_ranks import DataParallelRanks

    return DataParallelRanks(config, size)


async def recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Wait until `sock` has messages; take up to MAX_OUTPUTS_PER_BATCH of them."""
    fd = socket_fd(sock)
    while True:
        frames: list[bytes] = []
        while len(frames) < MAX_OUTPUTS_PER_BATCH:
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
