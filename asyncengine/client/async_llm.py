"""AsyncLLM: the engine as an async library — one async generator per request.

prompt → InputProcessor → EngineCoreRequest → EngineCoreClient → (core) → EngineCoreOutputs →
output handler task → OutputProcessor → RequestOutput → RequestStream → `generate()`.

`async with` owns everything: an anyio task group holding the output-handler and core-monitor
tasks, and the core (a spawned process, or a thread). Leaving it aborts what is in flight,
stops the core and joins every thread and process. Works on asyncio, uvloop and trio.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from asyncengine.client.chat import ChatPrompt, Conversation, render_chat
from asyncengine.client.cores.client import EngineCoreClient, RankDied
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.client.cores.thread_client import ThreadCoreClient
from asyncengine.client.embedding import (
    EMBED_PARAMS,
    check_embed_options,
    embedding_inputs,
    finish_vector,
)
from asyncengine.client.engine_utilities import EngineUtilities
from asyncengine.client.input_processor import InputProcessor, Prompt, request_limits
from asyncengine.client.output_processor import OutputProcessor
from asyncengine.client.stream import RequestStream
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.config import EngineConfig
from asyncengine.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineGenerateError,
    EngineOverloadedError,
)
from asyncengine.ipc.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    UtilityResult,
)
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams, default_sampling_params

logger = logging.getLogger(__name__)

CORE_KINDS = ("process", "thread")
_PAUSE_MODES = ("abort", "wait", "keep")
# After the core process dies, wait this long for its ENGINE_CORE_DEAD (it says why).
_DEATH_REPORT_GRACE_S = 0.3


@dataclass(slots=True)
class _UtilityWaiter:
    event: anyio.Event
    result: UtilityResult | None = None
    dead: str | None = None


@dataclass(slots=True)
class _State:
    """Where the engine is in its life: new → running → (draining) → (dead) → closed."""

    started: bool = False
    closing: bool = False
    draining: bool = False
    paused: bool = False
    sleep_level: int = 0  # 0: awake
    stream_ended: anyio.Event | None = None  # set (and replaced) whenever a stream ends
    # While paused: new requests wait here, in the client, and go to the core on resume.
    held: list[tuple[EngineCoreRequest, int | None]] = field(default_factory=list)
    dead_error: EngineDeadError | None = None
    streams: dict[str, RequestStream] = field(default_factory=dict)
    utility_waiters: dict[int, _UtilityWaiter] = field(default_factory=dict)


class AsyncLLM(EngineUtilities):
    """An engine for async applications. Use it as an async context manager:

    >>> async with AsyncLLM.from_pretrained("path/to/model") as engine:
    ...     async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
    ...         print(out.outputs[0].text)

    `core="process"` (default) runs the engine core in a spawned process; `core="thread"` runs
    it in a background thread of this process (no sockets; for notebooks and tests).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        core: str = "process",
        startup_timeout: float = 300.0,
        core_client: EngineCoreClient | None = None,
    ) -> None:
        """`core_client`: the client's end of cores started elsewhere (an API server process
        of `serve --api-server-count`); otherwise the engine starts its own."""
        if core not in CORE_KINDS:
            raise ValueError(f"core={core!r} is invalid: must be one of {', '.join(CORE_KINDS)}")
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout={startup_timeout!r} is invalid: must be > 0")
        config.check_core_kind(core)
        self._config = config
        self._core_kind = core
        self._startup_timeout = float(startup_timeout)
        self._state = _State()
        self._call_ids = itertools.count()
        self._tokenizer: Tokenizer | None = None
        self._input_processor: InputProcessor | None = None
        self._output_processor: OutputProcessor | None = None
        self._core_client: EngineCoreClient | None = None
        self._given_core_client = core_client
        self._loras: dict[str, str] = {}  # the LoRA adapters added through this client
        self._task_group: anyio.abc.TaskGroup | None = None
        self._exit_stack: AsyncExitStack | None = None  # exits the task group at aclose()
        self._dead_event: anyio.Event | None = None  # set when the core is found dead

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        core: str = "process",
        startup_timeout: float = 300.0,
        **config: Any,
    ) -> AsyncLLM:
        """An engine for the local model folder `model`; start it with `async with`.

        `config` takes EngineConfig's keywords (dtype, device, block_size, num_kv_blocks,
        kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, max_model_len,
        enable_prefix_caching, scheduling_policy, seed); a bad value raises ValueError here.
        Start-up failures in the core raise EngineStartupError from `async with`.
        """
        return cls(
            EngineConfig.from_kwargs(model, **config),
            core=core,
            startup_timeout=startup_timeout,
        )

    # ---- life cycle ----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLM:
        if self._state.started:
            raise RuntimeError("this AsyncLLM was already started; make a new one")
        self._state.started = True
        model_dir = self._config.model_config.model
        client = self._make_core_client()
        self._core_client = client
        try:
            # A spawned core imports torch and loads the model while we load the tokenizer.
            await client.launch()
            self._tokenizer = await anyio.to_thread.run_sync(Tokenizer, model_dir)
            self._output_processor = OutputProcessor(self._tokenizer)
            await client.start()
        except BaseException:
            self._state.closing = True
            await client.shutdown()
            raise
        self._dead_event = anyio.Event()
        self._config = self._config.replace_cache(num_kv_blocks=client.num_kv_blocks)
        model_config = self._config.model_config
        self._input_processor = InputProcessor(
            self._tokenizer,
            model_config.vocab_size,
            request_limits(self._config),
            model_config.sampling_defaults,
        )
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        self._exit_stack, self._task_group = stack, tg
        tg.start_soon(self._output_handler, name="AsyncLLM output handler")
        tg.start_soon(self._monitor_core, name="AsyncLLM core monitor")
        return self

    def _make_core_client(self) -> EngineCoreClient:
        if self._given_core_client is not None:
            return self._given_core_client
        if self._core_kind == "thread":
            return ThreadCoreClient(self._config)
        return ProcCoreClient(self._config, self._startup_timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort every request in flight, stop the core, join every thread and process.

        Idempotent. Call it from the task that entered `async with` (which calls it anyway).
        Streams still open raise EngineDeadError afterwards.
        """
        state = self._state
        if state.closing or not state.started:
            return
        state.closing = True
        # 1. Abort what is in flight; open streams and utility calls end with EngineDeadError.
        assert self._output_processor is not None and self._core_client is not None
        live = list(self._output_processor.requests)
        if live and state.dead_error is None:
            self._core_client.abort_requests_nowait(self._output_processor.abort_requests(live))
        self._fail_everything("the engine was closed")
        # 2. Stop the output handler and the monitor.
        tg, self._task_group = self._task_group, None
        stack, self._exit_stack = self._exit_stack, None
        try:
            if tg is not None and stack is not None:
                tg.cancel_scope.cancel()
                await stack.aclose()
        finally:
            # 3. Stop the core and join its threads and process (shielded).
            await self._core_client.shutdown()

    # ---- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt | ChatPrompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (shaped by `params.output_kind`) until it finishes.

        Leaving the iterator early — break, cancellation, an exception — aborts the request in
        the core and frees its KV blocks (use `contextlib.aclosing` to make that immediate on
        `break`). ValueError for a bad request or a live duplicate `request_id`;
        EngineOverloadedError when `max_queued_requests` requests wait already;
        EngineDrainingError after `drain()`; EngineDeadError if the engine is gone, or dies
        meanwhile. `prompt` may also be a `ChatPrompt` that `render_chat` made.
        `data_parallel_rank` pins the request to that rank (with data parallel; else 0).
        `lora_request` runs it with that LoRA adapter (added first if the engine lacks it;
        ValueError for an unknown name without a path, or a bad adapter folder).
        """
        lora_name = await self._lora_name(lora_request)
        stream = self._add_request(
            prompt, params, request_id, priority, data_parallel_rank, lora_name=lora_name
        )
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self._abort_nowait(stream.request_id)

    async def chat(
        self,
        messages: Conversation,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`generate()` for a conversation: `messages` (`[{"role", "content"}, ...]`) rendered
        with the model's chat template, with the assistant's turn to come.

        ValueError for a bad message (unknown role, content that is not a string) or a model
        without a chat template; otherwise as `generate()`. `out.prompt` is the rendered text.
        """
        prompt = render_chat(self.tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
        # Closing this generator closes generate()'s at once, which aborts the request.
        outputs = self.generate(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        async with aclosing(outputs):
            async for output in outputs:
                yield output

    async def embed(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[list[float]]:
        """One embedding per input (a string, a list of token ids, or a list of those): the
        model's final hidden states over the input, pooled ("last": the last token's, for
        decoder embedding models such as Qwen3-Embedding; "mean": over every token; "cls":
        the first token's), cut to the first `dimensions` values (Matryoshka), then
        L2-normalized unless `normalize=False`. fp32 values, in input order.

        The inputs are prefilled beside generation requests in the same steps, never decoded.
        ValueError for a bad input or option (before anything runs); otherwise the errors of
        `generate()`. Cancelling the call aborts every input's request.
        """
        prompts = embedding_inputs(inputs)
        check_embed_options(pooling, normalize, dimensions, self._config.model_config.hidden_size)
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                streams.append(self._add_request(prompt, EMBED_PARAMS, None, 0, pooling=pooling))
            vectors = []
            for stream in streams:  # they run together in the core: wait for each in turn
                output = await stream.get()
                while not output.finished:
                    output = await stream.get()
                if output.embedding is None:
                    raise EngineGenerateError(
                        f"embedding request {stream.request_id} finished without an embedding"
                    )
                vectors.append(finish_vector(output.embedding, dimensions, normalize))
            return vectors
        finally:
            for stream in streams:
                if not stream.finished:
                    self._abort_nowait(stream.request_id)

    def _add_request(
        self,
        prompt: Prompt | ChatPrompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        data_parallel_rank: int | None = None,
        pooling: str | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        self._check_running()
        self._check_rank(data_parallel_rank)
        if self._state.draining:
            raise EngineDrainingError("the engine is draining: it takes no new requests")
        ip, op, client = self._input_processor, self._output_processor, self._core_client
        assert ip is not None and op is not None and client is not None
        if request_id is not None and request_id in op.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        frontend = self._config.frontend_config
        if op.num_queued >= frontend.local_max_queued_requests:
            raise EngineOverloadedError(
                f"{op.num_queued} requests already wait for their first output "
                f"({frontend.describe_queue_bound()}): retry later"
            )
        # Every check happens here (the core would refuse too, but asynchronously).
        request = ip.process(
            prompt, params, request_id=request_id, priority=priority, pooling=pooling,
            lora_name=lora_name,
        )  # fmt: skip
        op.add_request(request)
        stream = RequestStream(request.request_id, request.params.output_kind)
        self._state.streams[request.request_id] = stream
        if self._state.paused:
            self._state.held.extend((r, data_parallel_rank) for r in request.core_requests)
            return stream
        sent: list[str] = []
        try:
            for core_request in request.core_requests:
                client.add_request_nowait(core_request, data_parallel_rank)
                sent.append(core_request.request_id)
        except BaseException:
            # Nothing of a request that could not be sent stays behind, here or in the core.
            self._state.streams.pop(request.request_id, None)
            op.abort_requests([request.request_id])
            if sent:
                client.abort_requests_nowait(sent)
            raise
        return stream

    def _check_rank(self, rank: int | None) -> None:
        if rank is None:
            return
        assert self._core_client is not None
        size = self._core_client.data_parallel_size
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise ValueError(
                f"data_parallel_rank={rank!r} is invalid: must be an integer in [0, {size})"
            )
        dead = self._core_client.rank_errors().get(rank)
        if dead is not None:
            raise EngineDeadError(f"data_parallel_rank={rank} is dead: {dead}")

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Stop admitting requests and let those in flight finish.

        From the call on, `generate()` raises EngineDrainingError; the engine stays closed to
        new requests until it is closed. Returns once every request in flight has finished;
        past `timeout` seconds (None: no limit), aborts what is left: those streams end with
        finish_reason "abort". EngineDeadError if the engine is dead or closed. (The timeout
        is what drain does at its end, not a deadline on the call, hence a parameter.)
        """
        state = self._state
        if state.dead_error is not None or state.closing:
            self._check_running()
        state.draining = True
        with anyio.move_on_after(timeout):
            await self._wait_finished(list(state.streams))
        left = list(state.streams)
        for request_id in left:
            self.abort(request_id)
        if left:
            logger.warning("drain: aborted %d request(s) still running", len(left))

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating; new requests queue (in the client) until `resume_generation()`.

        `mode` says what happens to the requests in flight: "abort" ends them at once
        (finish_reason "abort"); "wait" lets them finish first, then returns; "keep"
        suspends them in place, their KV cache kept, to go on when resumed.
        """
        if mode not in _PAUSE_MODES:
            raise ValueError(f"mode={mode!r} is invalid: must be one of {', '.join(_PAUSE_MODES)}")
        self._check_running()
        state = self._state
        in_flight = list(state.streams)
        state.paused = True
        if mode == "abort":
            for request_id in in_flight:
                self.abort(request_id)
        elif mode == "wait":
            await self._wait_finished(in_flight)
        await self._call_utility("pause")

    async def resume_generation(self) -> None:
        """Generate again: requests kept in place go on, and those that queued are sent."""
        self._check_running()
        state = self._state
        if state.sleep_level:
            raise RuntimeError("the engine is sleeping: call wake_up(), which also resumes")
        await self._call_utility("resume")
        state.paused = False
        held, state.held = state.held, []
        assert self._core_client is not None and self._output_processor is not None
        live = self._output_processor.requests
        dead_ranks = self._core_client.rank_errors()
        for core_request, rank in held:
            request_id = core_request.request_id.partition("#")[0]
            # Requests abandoned while held never reach the core.
            if request_id not in live:
                continue
            if rank in dead_ranks:  # pinned to a rank that died while it was held
                stream = self._state.streams.pop(request_id, None)
                self._output_processor.abort_requests([request_id])
                if stream is not None:
                    stream.put_dead(f"data_parallel_rank={rank} is dead: {dead_ranks[rank]}")
                self._on_streams_ended()
                continue
            self._core_client.add_request_nowait(core_request, rank)

    async def sleep(self, level: int = 1) -> None:
        """Release memory while the engine is idle: level 1 the KV cache, level 2 the weights
        too (reloaded from the model folder on wake). Requests in flight finish first; new
        ones queue until `wake_up()`. The prefix cache starts empty after waking."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r} is invalid: must be 1 (KV cache) or 2 (and weights)")
        if not self._state.paused:
            await self.pause_generation(mode="wait")
        await self._call_utility("sleep", level)
        self._state.sleep_level = max(self._state.sleep_level, level)

    async def wake_up(self) -> None:
        """Reload what `sleep()` released, then serve the requests that queued meanwhile."""
        if self._state.sleep_level:
            await self._call_utility("wake_up")
            self._state.sleep_level = 0
        await self.resume_generation()

    @property
    def is_sleeping(self) -> bool:
        """True between `sleep()` and `wake_up()`."""
        return self._state.sleep_level > 0

    @property
    def is_paused(self) -> bool:
        """True between `pause_generation()` and `resume_generation()`."""
        return self._state.paused

    async def _wait_finished(self, request_ids: list[str]) -> None:
        state = self._state
        while any(r in state.streams for r in request_ids):
            if state.stream_ended is None:
                state.stream_ended = anyio.Event()
            await state.stream_ended.wait()

    @property
    def is_draining(self) -> bool:
        """True once `drain()` was called: new requests are refused."""
        return self._state.draining

    def _on_streams_ended(self) -> None:
        """Called whenever streams end: wakes `_wait_finished`."""
        state = self._state
        if state.stream_ended is not None:
            state.stream_ended.set()
            state.stream_ended = None

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort". Unknown ids: no-op."""
        op = self._output_processor
        if op is None or request_id not in op.requests:
            return
        final = op.make_abort_output(request_id)
        stream = self._state.streams.get(request_id)
        if stream is not None and final is not None:
            stream.put(final)
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        self._state.streams.pop(request_id, None)
        self._on_streams_ended()
        op, client = self._output_processor, self._core_client
        if op is None or client is None:
            return
        core_ids = op.abort_requests([request_id])
        if core_ids and self._state.dead_error is None and not self._state.closing:
            client.abort_requests_nowait(core_ids)

    # ---- utility calls (the public ones: client/engine_utilities.py) ------------------

    async def _call_utility(self, method: str, *args: Any) -> Any:
        self._check_running()
        assert self._core_client is not None
        call_id = next(self._call_ids)
        waiter = _UtilityWaiter(anyio.Event())
        self._state.utility_waiters[call_id] = waiter
        try:
            self._core_client.call_utility_nowait(UtilityCall(call_id, method, list(args)))
            await waiter.event.wait()
        finally:
            self._state.utility_waiters.pop(call_id, None)
        if waiter.dead is not None:
            raise EngineDeadError(waiter.dead)
        assert waiter.result is not None
        if waiter.result.error is not None:
            if method in _TYPED_ERROR_UTILITIES:
                raise _utility_error(method, waiter.result.error)
            raise RuntimeError(f"engine core {method}() failed: {waiter.result.error}")
        return waiter.result.result

    # ---- properties ----------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's settings (num_kv_blocks filled in once the core is ready)."""
        return self._config

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without any gets: the model's sampling defaults
        (its generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), SamplingParams' own for the rest. Start from it to change one field
        and keep the model's other defaults (`msgspec.structs.replace(p, max_tokens=64)`)."""
        return default_sampling_params(self._config.model_config.sampling_defaults)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the tokenizer is loaded when the engine starts (`async with`)")
        return self._tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine core is dead."""
        return self._state.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core died, or None while it is alive."""
        return self._state.dead_error

    @property
    def is_running(self) -> bool:
        s = self._state
        return s.started and not s.closing and s.dead_error is None and self._task_group is not None

    def _check_running(self) -> None:
        s = self._state
        if s.dead_error is not None:
            raise EngineDeadError(str(s.dead_error))
        if s.closing:
            raise EngineDeadError("the engine was closed")
        if self._task_group is None:
            raise RuntimeError(
                "the engine is not started: use `async with AsyncLLM.from_pretrained(...) "
                "as engine:`"
            )

    # ---- background tasks ----------------------------------------------------------------

    async def _output_handler(self) -> None:
        """Socket → OutputProcessor → per-request streams, until the core dies or we close."""
        client, op = self._core_client, self._output_processor
        assert client is not None and op is not None
        try:
            while True:
                for outputs in await client.get_outputs():
                    if isinstance(outputs, RankDied):
                        self._fail_rank(outputs)
                        continue
                    if outputs.engine_dead is not None:
                        reason = outputs.engine_dead
                        # The core reports the error that killed it; the client's own watch
                        # reports an exit or a silence, naming the core first (as dp_ranks).
                        if not reason.startswith("engine core"):
                            reason = f"the engine core died: {reason}"
                        self._set_dead(reason)
                        return
                    if outputs.utility_output is not None:
                        self._resolve_utility(outputs.utility_output)
                    if outputs.outputs:
                        self._process_outputs(outputs)
                # Let the streams' consumers run between batches.
                await anyio.lowlevel.checkpoint()
        except Exception as exc:  # a bug here must not leave streams waiting forever
            logger.exception("AsyncLLM output handler failed")
            self._set_dead(f"the output handler failed: {type(exc).__name__}: {exc}")

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        op, client = self._output_processor, self._core_client
        assert op is not None and client is not None
        processed = op.process_outputs(outputs)
        streams = self._state.streams
        for request_id, error in processed.failed:
            logger.warning("%s", error)
            failed = streams.pop(request_id, None)
            if failed is not None:
                failed.put_failure(error)
                self._on_streams_ended()
        for output in processed.request_outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del streams[output.request_id]
                    self._on_streams_ended()
        if processed.core_ids_to_abort:  # stop strings: the core still runs these sequences
            client.abort_requests_nowait(processed.core_ids_to_abort)

    def _fail_rank(self, died: RankDied) -> None:
        """One data-parallel rank died: its requests end with EngineDeadError; the others
        serve on."""
        op = self._output_processor
        assert op is not None
        reason = f"the engine core's data-parallel {died.reason}"
        for request_id in {core_id.partition("#")[0] for core_id in died.request_ids}:
            stream = self._state.streams.pop(request_id, None)
            op.abort_requests([request_id])  # forget it (the core that held it is gone)
            if stream is not None:
                stream.put_dead(reason)
        self._on_streams_ended()

    def _resolve_utility(self, result: UtilityResult) -> None:
        waiter = self._state.utility_waiters.get(result.call_id)
        if waiter is not None:
            waiter.result = result
            waiter.event.set()

    async def _monitor_core(self) -> None:
        assert self._core_client is not None
        reason = await self._core_client.wait_dead()
        if self._state.closing:
            return
        # The output handler may still be reading the core's own ENGINE_CORE_DEAD report.
        assert self._dead_event is not None
        with anyio.move_on_after(_DEATH_REPORT_GRACE_S):
            await self._dead_event.wait()
        self._set_dead(reason)

    def _set_dead(self, reason: str) -> None:
        if self._state.dead_error is not None:
            return
        logger.error("AsyncLLM: %s", reason)
        self._state.dead_error = EngineDeadError(reason)
        if self._dead_event is not None:
            self._dead_event.set()
        self._fail_everything(reason)

    def _fail_everything(self, reason: str) -> None:
        for stream in self._state.streams.values():
            stream.put_dead(reason)
        self._state.streams.clear()
        self._on_streams_ended()
        for waiter in self._state.utility_waiters.values():
            if waiter.result is None:  # an answer that arrived before the death stands
                waiter.dead = reason
                waiter.event.set()


# The errors of these utility methods that reach the caller as themselves (the core sends
# "TypeName: message", "rank N: TypeName: message" with data parallel); others, and every
# error of the other utility methods, are RuntimeErrors.
_TYPED_ERROR_UTILITIES = frozenset(
    {"collective_rpc", "start_profile", "stop_profile", "add_lora", "remove_lora"}
)
_UTILITY_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "TimeoutError": TimeoutError,
}


def _utility_error(method: str, error: str) -> Exception:
    rest = error
    if rest.startswith("rank "):
        rest = rest.partition(": ")[2]
    kind, sep, message = rest.partition(": ")
    if sep and kind in _UTILITY_ERRORS:
        return _UTILITY_ERRORS[kind](message)
    return RuntimeError(f"engine core {method}() failed: {error}")
