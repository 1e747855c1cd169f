"""DPCoreClient: several engine cores (data-parallel ranks) behind one client.

Each rank is a full engine core (its own scheduler, KV cache and executor) in a process of
its own. Every rank connects to this client's one output socket; each has its own input
socket. The Router picks a rank per request from the load each rank publishes with its
outputs; aborts go to the rank that holds the request; a utility call goes to every live
rank and comes back as one result (statistics: the total, with each rank's).

A dead rank is not a dead engine: its requests end with EngineDeadError naming it
(`RankDied` among the outputs), it gets nothing more, and the other ranks serve on. When
the last rank dies, or any with `data_parallel_fail_fast`, the engine is dead as with one
core. A rank is dead when its process exits, when it reports ENGINE_CORE_DEAD, or when it
has been silent past step_timeout (stopped or hung: it is killed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from asyncengine.client.core_client import (
    EngineCoreClient,
    RankDied,
    decode_outputs,
    recv_frames,
)
from asyncengine.client.core_process import CoreProcess, RunningCore, start_cores
from asyncengine.client.dp_router import Router
from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    UtilityCall,
    UtilityResult,
)
from asyncengine.ipc.serial import MsgpackEncoder, RequestPayload, encode_request
from asyncengine.ipc.sockets import (
    ipc_address,
    make_private_socket_dir,
    make_socket,
    remove_socket_dir,
    sweep_stale_socket_dirs,
)

if TYPE_CHECKING:
    from asyncengine.client.ray_cores import RayCluster

logger = logging.getLogger(__name__)

# A dead process's own ENGINE_CORE_DEAD (it says why) may still be on its way: wait this long
# before reporting the death from its exit status.
_DEATH_REPORT_GRACE_S = 0.3


@dataclass(slots=True)
class _PendingCall:
    method: str
    waiting_for: set[int]
    results: dict[int, UtilityResult] = field(default_factory=dict)


class DPCoreClient(EngineCoreClient):
    """`data_parallel_size` engine-core processes behind one client (mp backend).

    By default it starts the cores itself. With `attach`, it is one of several clients of
    cores that another process started and owns (API server processes: each is client
    `client_index`, and its outputs come to `output_address`, which it binds).
    """

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout: float,
        *,
        attach: list[RunningCore] | None = None,
        output_address: str | None = None,
        client_index: int = 0,
    ) -> None:
        parallel = config.parallel_config
        self.config = config
        self.size = parallel.data_parallel_size
        self.fail_fast = parallel.data_parallel_fail_fast
        self.client_index = client_index
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket_dir = make_private_socket_dir()
        self.cores: list[CoreProcess] | list[RunningCore]
        self._startup_timeout = startup_timeout
        self._ray: RayCluster | None = None
        if attach is not None:
            if len(attach) != self.size or output_address is None:
                raise ValueError("attach needs one RunningCore per rank and an output address")
            self.cores = attach
            self._output_address = output_address
        elif parallel.data_parallel_backend == "ray":
            from asyncengine.client.ray_cores import RayCluster

            self._ray = RayCluster(config)
            self.cores = []  # RayCores, once the cluster is connected (_launch)
            self._output_address = ""
        else:
            self.cores = [
                CoreProcess(
                    self._ctx,
                    config.for_rank(rank),
                    self._socket_dir,
                    name=f"engine core rank {rank}",
                    startup_timeout=startup_timeout,
                )
                for rank in range(self.size)
            ]
            self._output_address = ipc_address(self._socket_dir, "output")
        self._output: zmq.Socket[bytes] | None = None
        self._inputs: list[zmq.Socket[bytes] | None] = [None] * self.size
        # Deaths this client finds itself (an exit, silence) join the cores' own messages.
        self._self_report: zmq.Socket[bytes] | None = None
        self._encoder = MsgpackEncoder()
        # A rank may be `prefix_margin` load units busier than the least-loaded and still get
        # a request whose prefix it holds: up to a full batch (max_num_seqs) more waiting.
        self.router = Router(
            self.size,
            parallel.data_parallel_routing,
            block_size=config.cache_config.block_size,
            prefix_margin=4 * config.scheduler_config.max_num_seqs,
        )
        self._rank_of: dict[str, int] = {}  # core request id → its rank, while live
        self._last_base: tuple[str, int] | None = None  # n > 1 copies follow their first
        self._calls: dict[int, _PendingCall] = {}
        self._dead: dict[int, str] = {}  # rank → why
        self._last_heard = [time.monotonic()] * self.size
        self._engine_dead: str | None = None
        self._engine_dead_event = anyio.Event()
        self._shut_down = False

    @property
    def data_parallel_size(self) -> int:
        return self.size

    @property
    def socket_dir(self) -> Any:
        return self._socket_dir

    def rank_errors(self) -> dict[int, str]:
        return dict(self._dead)

    # ---- start-up ------------------------------------------------------------------------

    async def launch(self) -> None:
        try:
            await self._launch()
        except BaseException:
            await self.shutdown()
            raise

    async def _launch(self) -> None:
        if self._ray is not None and not self.cores:
            await self._connect_ray(self._ray)
        if self._output is None:
            self._output = make_socket(self._ctx, self._output_address, zmq.PULL, bind=True)
            # With tcp://host:* the socket picked a free port.
            self._output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
            self._self_report = make_socket(self._ctx, self._output_address, zmq.PUSH, bind=False)
        for core in self.cores:
            await core.launch()

    async def _connect_ray(self, cluster: RayCluster) -> None:
        """Connect to Ray, reserve a bundle per rank; a RayCore per rank (not started)."""
        from asyncengine.client.ray_cores import RayCore

        await anyio.to_thread.run_sync(cluster.start, self._startup_timeout)
        cores: list[CoreProcess] = [
            RayCore(
                self._ctx,
                self.config.for_rank(rank),
                cluster,
                name=f"engine core rank {rank}",
                startup_timeout=self._startup_timeout,
            )
            for rank in range(self.size)
        ]
        self.cores = cores
        self._output_address = f"tcp://{cluster.node_ip}:*"

    async def start(self) -> None:
        """Every rank starts at once; the first that fails stops them all (its rank and
        root cause in the EngineStartupError)."""
        try:
            await self._launch()
            if not isinstance(self.cores[0], RunningCore):  # else: started by their owner
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
        sock = self._inputs[rank]
        if sock is None or rank in self._dead:
            return
        sock.send_multipart(encode_request(self._encoder, request_type, payload), zmq.NOBLOCK)

    def add_request_nowait(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        base = request.request_id.partition("#")[0]
        if data_parallel_rank is not None:
            rank = data_parallel_rank
        elif "#" in request.request_id and self._last_base and self._last_base[0] == base:
            rank = self._last_base[1]  # another copy (`id#i`) of an n > 1 request: its rank
        else:
            rank = self.router.route(request.prompt_token_ids)
        self._last_base = (base, rank)
        self._rank_of[request.request_id] = rank
        request.client_index = self.client_index
        self.router.sent(rank)
        self._send(rank, EngineCoreRequestType.ADD, request)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, EngineCoreRequestType.ABORT, ids)

    def call_utility_nowait(self, call: UtilityCall) -> None:
        live = set(self.router.live)
        call.client_index = self.client_index
        self._calls[call.call_id] = _PendingCall(call.method, live)
        for rank in live:
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
                batch.extend(self._take(outputs, now))
            if batch:
                return batch

    def _take(self, outputs: EngineCoreOutputs, now: float) -> list[EngineCoreOutputs | RankDied]:
        """Book-keeping for one message from rank `outputs.engine_index`; what to pass on."""
        rank = outputs.engine_index
        if not 0 <= rank < self.size or rank in self._dead:
            return []  # a dead rank's last words (or a stray frame): already accounted for
        if outputs.engine_dead is not None:
            return self._rank_died(rank, outputs.engine_dead)
        self._last_heard[rank] = now
        if outputs.load is not None:
            self.router.report(rank, outputs.load)
        passed: list[EngineCoreOutputs | RankDied] = []
        if outputs.outputs:
            for output in outputs.outputs:
                if output.finished:
                    self._rank_of.pop(output.request_id, None)
            passed.append(outputs)
        result = outputs.utility_output
        if result is not None:
            combined = self._utility_answered(rank, result)
            if combined is not None:
                passed.append(EngineCoreOutputs(utility_output=combined))
        return passed

    def _utility_answered(self, rank: int, result: UtilityResult) -> UtilityResult | None:
        call = self._calls.get(result.call_id)
        if call is None:
            return None
        call.results[rank] = result
        call.waiting_for.discard(rank)
        return self._finish_call(result.call_id) if not call.waiting_for else None

    def _finish_call(self, call_id: int) -> UtilityResult:
        """Every live rank has answered: one result (the first error, or the combination)."""
        call = self._calls.pop(call_id)
        for rank, result in sorted(call.results.items()):
            if result.error is not None:
                return UtilityResult(call_id, error=f"rank {rank}: {result.error}")
        if not call.results:
            return UtilityResult(call_id, error="no data-parallel rank is alive")
        if call.method == "statistics":
            ranks = [
                msgspec.convert(r.result, EngineStats) for _, r in sorted(call.results.items())
            ]
            return UtilityResult(call_id, result=msgspec.to_builtins(EngineStats.total(ranks)))
        return UtilityResult(call_id, result=call.results[min(call.results)].result)

    def _rank_died(self, rank: int, reason: str) -> list[EngineCoreOutputs | RankDied]:
        reason = (
            reason
            if reason.startswith("engine core rank")
            else f"engine core rank {rank}: {reason}"
        )
        self._dead[rank] = reason
        self.router.remove(rank)
        logger.error("data parallel: %s", reason)
        passed: list[EngineCoreOutputs | RankDied] = []
        # Utility calls waiting on it are answered by the others.
        for call_id, call in list(self._calls.items()):
            call.waiting_for.discard(rank)
            if not call.waiting_for:
                passed.append(EngineCoreOutputs(utility_output=self._finish_call(call_id)))
        lost = [r for r, k in self._rank_of.items() if k == rank]
        for request_id in lost:
            del self._rank_of[request_id]
        if self.fail_fast or not self.router.live:
            why = "data_parallel_fail_fast" if self.router.live else "no rank is left"
            self._engine_dead = f"{reason} ({why})"
            self._engine_dead_event.set()
            passed.append(EngineCoreOutputs(engine_dead=self._engine_dead))
        else:
            passed.append(RankDied(rank, reason, lost))
        return passed

    def silent_for(self) -> float:
        now = time.monotonic()
        return max((now - self._last_heard[r] for r in self.router.live), default=0.0)

    # ---- deaths --------------------------------------------------------------------------

    async def wait_dead(self) -> str:
        now = time.monotonic()
        self._last_heard = [now] * self.size  # serving starts now
        async with anyio.create_task_group() as tg:
            for rank in range(self.size):
                tg.start_soon(self._watch_rank, rank)
            await self._engine_dead_event.wait()
            tg.cancel_scope.cancel()
        assert self._engine_dead is not None
        return self._engine_dead

    async def _watch_rank(self, rank: int) -> None:
        """Report the rank's death among the outputs, once: its exit, or silence past
        step_timeout (then it is killed)."""
        core, limit = self.cores[rank], self.config.step_timeout
        while not await core.wait_exit():
            if rank in self._dead:
                return
            silent = time.monotonic() - self._last_heard[rank]
            if silent > limit:
                await core.stop(kill=True)
                self._report_death(
                    rank,
                    f"engine core rank {rank} process (pid {core.pid}) sent nothing for "
                    f"{silent:.1f} s, past step_timeout={limit:g} s: it was stopped or hung, "
                    "and is killed",
                )
                return
        await anyio.sleep(_DEATH_REPORT_GRACE_S)
        self._report_death(
            rank, f"engine core rank {rank} process (pid {core.pid}) died: {core.exit_desc()}"
        )

    def _report_death(self, rank: int, reason: str) -> None:
        sock = self._self_report
        if sock is None or rank in self._dead:
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
            self._inputs = [None] * self.size
            async with anyio.create_task_group() as tg:
                for core in self.cores:
                    tg.start_soon(core.stop)
            if self._ray is not None:
                await anyio.to_thread.run_sync(self._ray.stop)
            for sock in (self._output, self._self_report):
                if sock is not None:
                    sock.close(linger=0)
            self._output = self._self_report = None
            self._ctx.term()
            remove_socket_dir(self._socket_dir)
            sweep_stale_socket_dirs()
