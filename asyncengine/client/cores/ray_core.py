"""Engine cores on a Ray cluster (`data_parallel_backend="ray"`): ranks on any machine.

Each rank is an `EngineCoreActor` placed by one placement group (a bundle per rank, with the
rank's CPUs, and GPUs on CUDA; `data_parallel_placement` packs the bundles onto as few nodes
as they fit, or spreads them). The actor starts the engine core on its node as a child
process (`python -m asyncengine.core.engine_core_proc`, with its TP workers beside it) and
reports its exit; the core talks to the client over tcp:// ZMQ, with the same handshake and
msgspec frames as a local core: Ray carries the launch only, never a request or an output.

If the application has connected to a Ray cluster already (`ray.init(...)`), that connection
is used; otherwise the engine connects as `ray.init()` would (`RAY_ADDRESS`, or a local
cluster of its own, which it shuts down at the end). Killing an actor kills its core (the
core watches its parent); `aclose()` stops every core, kills every actor and removes the
placement group.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import anyio
import zmq

from asyncengine.child_process import ChildProcess
from asyncengine.client.cores.handle import CoreBackend, CoreHandle
from asyncengine.client.cores.handshake import Handshake, HandshakeCore
from asyncengine.client.cores.process import exit_desc, stop_process_tree
from asyncengine.config import EngineConfig
from asyncengine.errors import EngineStartupError
from asyncengine.ipc.messages import EngineCoreLaunch
from asyncengine.ipc.serial import MsgpackEncoder

logger = logging.getLogger(__name__)

PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
_ACTOR_CALL_TIMEOUT_S = 60.0


class EngineCoreActor:
    """Runs in a Ray worker on the rank's node: starts the engine core, reports its exit."""

    def __init__(self) -> None:
        self.proc: ChildProcess | None = None

    def node_ip(self) -> str:
        import ray.util

        return str(ray.util.get_node_ip_address())

    def start(self, launch: bytes) -> int:
        """Start the core with its launch arguments; its pid."""
        proc = ChildProcess("asyncengine.core.engine_core_proc", launch, name="AsyncEngineCore")
        proc.start()
        self.proc = proc
        assert proc.pid is not None
        return proc.pid

    def wait(self) -> str:
        """Block until the core exits; how it did."""
        assert self.proc is not None
        while self.proc.is_alive():
            self.proc.join(1.0)
        return exit_desc(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.sentinel >= 0:
            stop_process_tree(self.proc)


class RayCluster:
    """The engine's Ray connection and its placement group (blocking calls: run them in a
    worker thread)."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        self.size = parallel.data_parallel_size
        self.strategy = PLACEMENTS[parallel.data_parallel_placement]
        self.bundle: dict[str, float] = {"CPU": float(parallel.tensor_parallel_size)}
        if config.device_config.device == "cuda":
            # A GPU per TP worker. The actor asks for them all (num_gpus), so Ray sets its
            # CUDA_VISIBLE_DEVICES to them; its core and workers inherit that, and worker t
            # runs on cuda:t (executor/placement.py): no two ranks share a GPU.
            self.bundle["GPU"] = float(parallel.tensor_parallel_size)
        self.owns_ray = False
        self.placement_group: Any = None
        self.node_ip = "127.0.0.1"

    def start(self, timeout: float) -> None:
        try:
            import ray
            import ray.util
        except ImportError:
            raise EngineStartupError(
                "data_parallel_backend='ray' needs ray: pip install 'ray>=2.40' (the `ray` extra)"
            ) from None
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"logging_level": logging.WARNING}
            if not os.environ.get("RAY_ADDRESS"):
                kwargs["include_dashboard"] = False  # a local cluster of the engine's own
            ray.init(**kwargs)
            self.owns_ray = True
        self.node_ip = str(ray.util.get_node_ip_address())
        self.placement_group = placement_group(
            [dict(self.bundle) for _ in range(self.size)], strategy=self.strategy
        )
        try:
            ray.get(self.placement_group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise EngineStartupError(
                f"the Ray cluster has no room for {self.size} bundle(s) of {self.bundle} "
                f"(placement {self.strategy}) within {timeout:g} s: "
                f"cluster resources {ray.available_resources()}"
            ) from None

    def make_actor(self, index: int, name: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {
            "num_cpus": self.bundle["CPU"],
            "num_gpus": self.bundle.get("GPU", 0),
            "max_concurrency": 4,  # wait() blocks while stop() may come
            "name": None,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            ),
        }
        logger.info("placing %s on bundle %d", name, index)
        return ray.remote(EngineCoreActor).options(**options).remote()

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_ray:
            ray.shutdown()


class RayCore(HandshakeCore):
    """One rank's engine core in a Ray actor, through the same Handshake as a CoreProcess."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: EngineConfig,
        cluster: RayCluster,
        *,
        name: str,
        startup_timeout: float,
    ) -> None:
        self.config = config
        self.name = name
        self.startup_timeout = startup_timeout
        self.cluster = cluster
        # A free port of this host's, and (once launched) of the core's node.
        self.input_address = "tcp://127.0.0.1:*"
        self._handshake = Handshake(
            ctx,
            f"tcp://{cluster.node_ip}:*",
            name=name,
            startup_timeout=startup_timeout,
            alive=self._alive,
            exit_desc=self.exit_desc,
        )
        self.actor: Any = None
        self._pid: int | None = None
        self._wait_ref: Any = None
        self._exit: str | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    async def launch(self) -> None:
        if self.actor is not None:
            return
        self._handshake.start_clock()
        await anyio.to_thread.run_sync(self._launch_actor)

    def _launch_actor(self) -> None:
        import ray

        rank = self.config.parallel_config.data_parallel_rank
        self.actor = self.cluster.make_actor(rank, self.name)
        node_ip = ray.get(self.actor.node_ip.remote(), timeout=self.startup_timeout)
        self.input_address = f"tcp://{node_ip}:*"
        launch = EngineCoreLaunch(self.config, self._handshake.address)
        self._pid = ray.get(
            self.actor.start.remote(MsgpackEncoder().encode(launch)), timeout=_ACTOR_CALL_TIMEOUT_S
        )
        self._wait_ref = self.actor.wait.remote()

    def _alive(self) -> bool:
        return self._wait_ref is not None and not self._ready(0)

    def _ready(self, timeout: float) -> bool:
        import ray

        ready, _ = ray.wait([self._wait_ref], timeout=timeout)
        if ready and self._exit is None:
            try:
                self._exit = str(ray.get(self._wait_ref))
            except Exception as exc:  # the actor died (killed, or its node lost)
                self._exit = f"its Ray actor died ({type(exc).__name__})"
        return bool(ready)

    async def wait_exit(self, poll: float = 0.5) -> bool:
        assert self._wait_ref is not None
        return await anyio.to_thread.run_sync(self._ready, poll)

    def exit_desc(self) -> str:
        return self._exit or "still running"

    async def stop(self, kill: bool = False) -> None:
        with anyio.CancelScope(shield=True):
            self._handshake.close()
            if self.actor is not None:
                await anyio.to_thread.run_sync(self._stop_actor, kill)

    def _stop_actor(self, kill: bool) -> None:
        import ray

        actor, self.actor = self.actor, None
        if actor is None:
            return
        if not kill:
            with contextlib.suppress(Exception):  # dead already: nothing to stop
                ray.get(actor.stop.remote(), timeout=_ACTOR_CALL_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(actor)


class RayBackend(CoreBackend):
    """Cores as Ray actors' children, placed by one placement group (the ray backend)."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.cluster = RayCluster(config)
        self._ctx = ctx

    async def open(self, startup_timeout: float) -> None:
        """Connect to Ray and reserve a bundle per rank."""
        await anyio.to_thread.run_sync(self.cluster.start, startup_timeout)

    def output_address(self) -> str:
        return f"tcp://{self.cluster.node_ip}:*"

    def make_core(self, config: EngineConfig, name: str, startup_timeout: float) -> CoreHandle:
        rank = config.parallel_config.data_parallel_rank
        # Ray ranks are always named by rank, even alone: the actor is placed by it.
        return RayCore(
            self._ctx,
            config,
            self.cluster,
            name=f"engine core rank {rank}",
            startup_timeout=startup_timeout,
        )

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.cluster.stop)
