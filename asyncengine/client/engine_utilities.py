"""AsyncLLM's calls to the engine core's utility methods: health, statistics, the prefix
cache, the worker extension's methods, profiling, and LoRA adapters.

A base class of AsyncLLM (client/async_llm.py), which owns the core client and the round trip
itself (`_call_utility`: a call id, a waiter, the core's answer or death).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec

from asyncengine.client.cores.client import UNRESPONSIVE_AFTER_S, EngineCoreClient
from asyncengine.client.llm_engine import rpc_arguments
from asyncengine.client.lora import adapter_folder, resolve_lora
from asyncengine.ipc.messages import EngineStats
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import EngineHealth, RankHealth


class EngineUtilities:
    """The utility calls of AsyncLLM (see there for the engine's life)."""

    _core_client: EngineCoreClient | None
    _loras: dict[str, str]  # the LoRA adapters added through this client: name -> folder

    def _check_running(self) -> None:
        raise NotImplementedError

    async def _call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def check_health(self, timeout: float = 10.0) -> EngineHealth:  # noqa: ASYNC109
        """A round trip to the core: EngineDeadError if it is gone, TimeoutError if it does
        not answer within `timeout` seconds (it is hung, or stuck in a very long step).

        The timeout is part of what is checked, hence a parameter rather than a cancel scope.
        A core process that has sent nothing (not even its heartbeat) for a few seconds fails
        at once: it is stopped or hung. With data parallel, every live rank answers, and the
        result says which ranks are dead (`degraded`) while the others serve.
        """
        self._check_running()
        assert self._core_client is not None
        silent = self._core_client.silent_for()
        if silent > UNRESPONSIVE_AFTER_S:
            raise TimeoutError(
                f"the engine core has sent nothing for {silent:.1f} s, not even a heartbeat: "
                "it is stopped or hung"
            )
        try:
            with anyio.fail_after(timeout):
                await self._call_utility("check_health")
        except TimeoutError:
            raise TimeoutError(
                f"the engine core did not answer a health check within {timeout} s"
            ) from None
        dead = self._core_client.rank_errors()
        return EngineHealth(
            tuple(
                RankHealth(rank, rank not in dead, dead.get(rank))
                for rank in range(self._core_client.data_parallel_size)
            )
        )

    async def statistics(self, timeout: float = 10.0) -> EngineStats:  # noqa: ASYNC109
        """A frozen snapshot of the core: running/waiting requests, KV blocks used/total,
        prefix-cache hits (a round trip to the core). TimeoutError if the core does not
        answer within `timeout` seconds, as `check_health`: a stopped core never answers."""
        try:
            with anyio.fail_after(timeout):
                result = await self._call_utility("statistics")
        except TimeoutError:
            raise TimeoutError(
                f"the engine core did not answer a statistics call within {timeout} s"
            ) from None
        return msgspec.convert(result, EngineStats)

    async def get_stats(self, timeout: float = 10.0) -> EngineStats:  # noqa: ASYNC109
        """The same as `statistics()` (vLLM's name)."""
        return await self.statistics(timeout)

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's contents: later requests find no cached prefix. Blocks
        that running requests use stay theirs. Returns True."""
        return bool(await self._call_utility("reset_prefix_cache"))

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[Any]:
        """Call `method` of the worker extension (`worker_extension_cls`) on every worker;
        one result per worker, in tensor-parallel rank order.

        With data parallel the call runs on every live rank's workers, and the list is the
        first live rank's (as vLLM). Arguments and results cross processes as msgpack:
        TypeError naming the method for ones msgspec cannot encode; tuples arrive as lists.
        ValueError naming the method, and listing the callable ones, for any other method
        (the engine's own, such as load_model or execute_model, are never callable).
        TimeoutError past `timeout` seconds: the call is abandoned, not interrupted (the
        workers finish it, then serve on). RuntimeError with the worker's error when the
        method raises. The engine serves on after every one of these errors.
        """
        # Checked here for every core kind (a thread core would not encode them).
        wire_args, wire_kwargs = rpc_arguments(method, args, kwargs)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} is invalid: must be seconds > 0 or None")
        call = self._call_utility("collective_rpc", method, wire_args, wire_kwargs, timeout)
        if timeout is None:
            return list(await call)
        try:
            # The core enforces it with worker processes; here it also holds in-process.
            with anyio.fail_after(timeout):
                return list(await call)
        except TimeoutError:
            raise TimeoutError(
                f"collective_rpc({method!r}) did not finish within {timeout} s"
            ) from None

    async def start_profile(self, profile_dir: str | os.PathLike[str] | None = None) -> None:
        """Start torch.profiler in every worker (of every data-parallel rank); `stop_profile()`
        writes one chrome trace per worker into `profile_dir` (made if missing), named
        `dp{rank}-tp{worker}.{time_ns}.pt.trace.json`. ValueError without `profile_dir`;
        RuntimeError if a profile is already running."""
        if profile_dir is None:
            raise ValueError(
                "start_profile() needs a profile_dir: the folder the traces are written to"
            )
        await self._call_utility("start_profile", str(await anyio.Path(profile_dir).absolute()))

    async def stop_profile(self) -> None:
        """Stop the profile `start_profile()` started and write its traces (RuntimeError if
        none is running)."""
        await self._call_utility("stop_profile")

    # ---- LoRA adapters --------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter (a PEFT folder) under its name, for requests to name it; False
        if the engine holds it from that folder already. ValueError naming what is wrong: an
        engine without `enable_lora`, a missing or non-PEFT folder, an adapter for other
        shapes or modules, a rank above `max_lora_rank`, a name held from another folder."""
        name, folder = adapter_folder(lora_request)
        self._check_running()
        added = bool(await self._call_utility("add_lora", name, folder))
        self._loras[name] = folder
        return added

    async def remove_lora(self, name: str) -> None:
        """Unload adapter `name`: new requests for it are refused at once; those in flight
        finish with it first. ValueError for a name the engine does not hold."""
        self._check_running()
        await self._call_utility("remove_lora", name)
        self._loras.pop(name, None)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine holds, by name."""
        self._check_running()
        held = await self._call_utility("list_loras")
        self._loras = {name: path for name, path in held}
        return [LoRARequest(name, path) for name, path in held]

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The adapters added through this engine (`add_lora`, or a request's first use), by
        name: what the HTTP server's `model` field may name."""
        return tuple(sorted(self._loras))

    async def _lora_name(self, lora_request: LoRARequest | None) -> str | None:
        """The adapter name a request runs with; added first where the engine lacks it."""
        name, folder = resolve_lora(lora_request, self._loras)
        if name is not None and folder is not None:
            await self.add_lora(LoRARequest(name, folder))
        return name
