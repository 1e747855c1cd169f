"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step shares one token budget (`max_num_batched_tokens`) between the running requests
(decodes and unfinished prefill chunks, served first) and the waiting ones (admitted in policy
order while the budget, `max_num_seqs` and the KV cache allow). When the cache runs out, the
policy's victim is preempted: its blocks are freed and it is recomputed later from scratch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from asyncengine.config import SchedulerConfig
from asyncengine.ipc.messages import (
    POOLING_TYPES,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
)
from asyncengine.ipc.scheduler_output import (
    INVALID_TOKEN_ID,
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncengine.request_limits import RequestLimits, check_token_ids
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.lora_slots import LoRASlots
from asyncengine.sched.request import Request, RequestStatus
from asyncengine.sched.request_queue import make_request_queue
from asyncengine.sched.spec_decode import NgramSpeculator
from asyncengine.sched.structured_outputs import StructuredOutputManager


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        vocab_size: int | None = None,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = eos_token_ids
        # The client checks the same limits; the core checks them again for any client.
        self.limits = RequestLimits(
            config.max_model_len,
            kv_cache_manager.block_size,
            kv_cache_manager.num_blocks,
            config.max_num_seqs,
        )
        self.vocab_size = vocab_size  # token ids are checked against it when given
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy, config.max_num_batched_tokens)
        self.running: list[Request] = []
        # Structured outputs: requests wait here, beside the queue, until their grammar is
        # compiled, so a slow compile holds up no one else.
        self.structured_outputs = structured_outputs
        self.waiting_for_grammar: list[Request] = []
        # Set by the engine core when its executor fills bitmasks beside the forward pass.
        self.defer_grammar_fill = False
        self._deferred_rows: list[Request] = []
        self._failed_outputs: list[EngineCoreOutput] = []  # reported by the next update
        self.finished_req_ids: list[str] = []  # since the last schedule(): workers drop them
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens computed for prompts and recomputes, in all
        self.speculator = NgramSpeculator(config.speculative) if config.speculative else None
        # LoRA adapters (set by the engine core when LoRA is enabled); None: the base only.
        self.lora_slots: LoRASlots | None = None

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a validated request; ValueError if its id is live or it can never fit."""
        if core_request.request_id in self.requests:
            raise ValueError(f"request_id {core_request.request_id!r} is already in use")
        request_id, params = core_request.request_id, core_request.sampling_params
        if self.vocab_size is not None:
            # Cheap, and a bad id would fail the whole step: one bad frame must not kill all.
            check_token_ids(core_request.prompt_token_ids, self.vocab_size)
        if core_request.pooling not in POOLING_TYPES:
            kinds = ", ".join(str(k) for k in POOLING_TYPES[1:])
            raise ValueError(f"pooling={core_request.pooling!r} is invalid: one of {kinds}")
        max_tokens = self.limits.check(request_id, len(core_request.prompt_token_ids), params)
        request = Request.from_core_request(core_request, max_tokens)
        if core_request.lora_name is not None:
            if self.lora_slots is None:
                raise ValueError("LoRA adapters need an engine started with enable_lora=True")
            request.hash_seed = self.lora_slots.hash_seed(core_request.lora_name)
        if params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError("this engine core was built without structured outputs")
            request.grammar = self.structured_outputs.grammar_for(params.structured_outputs)
            self.requests[request.request_id] = request
            self.waiting_for_grammar.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Finish requests early (client abort); their blocks are freed at once. Returns the
        ids that were live (unknown and finished ones are skipped)."""
        aborted: list[str] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            aborted.append(req_id)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
            self._free_request(request)
        return aborted

    def _free_request(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        self.finished_req_ids.append(request.request_id)
        del self.requests[request.request_id]

    def has_requests(self) -> bool:
        return bool(self.requests)

    # ---- structured outputs --------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; fail those whose grammar is invalid."""
        if not any(
            r.grammar is not None and r.grammar.is_ready() for r in self.waiting_for_grammar
        ):
            return
        still: list[Request] = []
        for request in self.waiting_for_grammar:
            assert request.grammar is not None
            if not request.grammar.is_ready():
                still.append(request)
                continue
            try:
                request.grammar.start()
            except ValueError as exc:  # the constraint itself is invalid: its sender's fault
                self._fail_waiting(request, str(exc), bad_request=True)
            except Exception as exc:  # e.g. the tokenizer could not be read
                self._fail_waiting(request, f"its grammar failed: {type(exc).__name__}: {exc}")
            else:
                self.waiting.add(request)
        self.waiting_for_grammar = still

    def _fail_waiting(self, request: Request, error: str, *, bad_request: bool = False) -> None:
        request.finish_reason = FinishReason.ABORT
        self._free_request(request)
        self._failed_outputs.append(
            EngineCoreOutput(
                request.request_id,
                [],
                finish_reason=FinishReason.ABORT,
                error=error,
                bad_request=bad_request,
            )
        )

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending grammar, when nothing else can run (so an
        engine with only compiling requests does not spin)."""
        if self.structured_outputs is None or not self.waiting_for_grammar:
            return
        if self.running or self.waiting:
            return
        self.structured_outputs.wait_any(
            [r.grammar for r in self.waiting_for_grammar if r.grammar is not None], timeout
        )

    def _grammar_bitmask(self, num_scheduled: dict[str, int]) -> GrammarBitmask | None:
        """The bitmask rows of this step's constrained requests that sample (a prefill chunk
        short of the end samples nothing). With `defer_grammar_fill`, None: the rows wait for
        `take_grammar_fill()`."""
        if self.structured_outputs is None:
            return None
        rows = [
            request
            for req_id in num_scheduled
            if (request := self.requests[req_id]).grammar is not None
            and request.num_computed_tokens == request.num_tokens
        ]
        if not rows:
            return None
        if self.defer_grammar_fill:
            self._deferred_rows = rows
            return None
        return self._fill(rows)

    def _fill(self, rows: list[Request]) -> GrammarBitmask:
        assert self.structured_outputs is not None
        bitmask = self.structured_outputs.fill_bitmask([r.grammar for r in rows if r.grammar])
        return GrammarBitmask([r.request_id for r in rows], bitmask)

    def take_grammar_fill(self) -> Callable[[], GrammarBitmask | None] | None:
        """The last `schedule()`'s bitmask, deferred (`defer_grammar_fill`): a function that
        fills it, to run while the step's forward pass does (the grammars' state does not
        change until `update_from_output`). None when the step has no constrained row."""
        rows, self._deferred_rows = self._deferred_rows, []
        return functools.partial(self._fill, rows) if rows else None

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch; every chosen request's blocks are allocated."""
        if self.waiting_for_grammar:
            self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        preempted = False

        spec_tokens: dict[str, list[int]] = {}
        if self.speculator is not None:
            self.speculator.begin_step(len(self.running))

        # 1. Running requests first: a decode token each (and its drafts, when speculating),
        # or their next prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(drafts))
            if new_block_ids is None and drafts:  # no room for the drafts: decode plainly
                drafts = []
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            num_new += len(drafts)
            while new_block_ids is None:
                victim = self.waiting.pick_victim(self.running)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                continue  # `request` itself was preempted; running[i] is now the next one
            cached_reqs.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            num_scheduled[request.request_id] = num_new
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= num_new
            # A priority victim may have stood before `request`, shifting it left.
            i = self.running.index(request) + 1 if preempted else i + 1
        # A request preempted after it was scheduled must not stay in this step's batch.
        if preempted:
            live = {r.request_id for r in self.running}
            cached_reqs = [c for c in cached_reqs if c.request_id in live]
            num_scheduled = {k: v for k, v in num_scheduled.items() if k in live}
            spec_tokens = {k: v for k, v in spec_tokens.items() if k in live}
            budget = self.config.max_num_batched_tokens - sum(num_scheduled.values())

        # 2. Then waiting requests, unless this step already had to preempt.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if self.lora_slots is not None and not self.lora_slots.fits(request, self.running):
                # Its adapter waits for a slot (max_loras adapters run already): a request
                # behind it that may run goes first.
                found = self.lora_slots.first_fitting(self.waiting, self.running)
                if found is None:
                    break
                request = found
            if request.sampling_params.prompt_logprobs is None and request.pooling is None:
                computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            else:  # every prompt position's logits (or hidden states) are wanted: nothing is
                # taken from the cache
                computed_blocks, num_cached = [], 0
            num_new = min(request.num_tokens - num_cached, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                break
            if request is self.waiting.peek():
                self.waiting.pop()
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            new_reqs.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_cached,
                    pooling=request.pooling,
                    lora_name=request.lora_name,
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        # 3. Advance the computed counts: the step will compute exactly these tokens.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            self.num_prefill_tokens += _num_prefill(request, n)
            request.num_computed_tokens += n
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            grammar_bitmask=self._grammar_bitmask(num_scheduled),
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = []
        return output

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Speculative decoding's draft tokens for `request` this step ([]: none)."""
        if self.speculator is None:
            return []
        return self.speculator.draft(request, budget, self.config.max_model_len)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.append(request.request_id)  # workers drop its state
        self.waiting.add_preempted(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, finish requests that stop, and report what is new."""
        outputs, self._failed_outputs = self._failed_outputs, []
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        pooled = runner_output.pooled
        for idx, (req_id, token_ids) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            request = self.requests.get(req_id)
            vector = pooled[idx] if pooled is not None else None
            if request is not None and vector is not None:
                # An embedding request's prompt is computed: it ends here, nothing decoded.
                request.finish_reason = FinishReason.STOP
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id, new_token_ids=[], pooled=vector,
                        finish_reason=FinishReason.STOP, num_cached_tokens=0,
                    )
                )  # fmt: skip
                self.running.remove(request)
                self._free_request(request)
                continue
            prompt_entries = prompt_logprobs[idx] if prompt_logprobs is not None else None
            if request is not None and not token_ids and prompt_entries is not None:
                # A prefill chunk that samples nothing, but computed prompt logprobs.
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id, new_token_ids=[], new_prompt_logprobs=prompt_entries
                    )
                )
                continue
            if request is None or not token_ids:
                continue  # aborted meanwhile, or a prefill chunk that samples nothing
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and self.speculator is not None:
                self.speculator.rollback(
                    request, len(drafts), len(token_ids), self.kv_cache_manager
                )
            new_token_ids: list[int] = []
            error = None
            for token_id in token_ids:
                if token_id == INVALID_TOKEN_ID:
                    request.finish_reason = FinishReason.ABORT
                    error = "the model's logits for this request were NaN: nothing to sample"
                    break
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if request.grammar is not None and not request.grammar.accept(token_id):
                    # The bitmask allowed only what the grammar accepts: this is a bug, and
                    # it fails this request alone.
                    request.finish_reason = FinishReason.ABORT
                    error = (
                        f"token {token_id} was sampled against the request's grammar (can "
                        "the tokenizer spell what the grammar needs? min_tokens past its end?)"
                    )
                    break
                if self._check_stop(request, token_id):
                    break
                if request.grammar is not None and request.grammar.is_terminated:
                    request.finish_reason = FinishReason.STOP  # ignore_eos: the grammar ended
                    break
            entries = logprobs[idx] if logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    # Cut where a stop cut the tokens (several, with speculative decoding).
                    new_logprobs=entries[: len(new_token_ids)] if entries is not None else None,
                    new_prompt_logprobs=prompt_entries,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=error,
                )
            )
            if request.finish_reason is not None:
                self.running.remove(request)
                self._free_request(request)
        return EngineCoreOutputs(outputs=outputs)

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long the executor took for `scheduler_output` (the "sjf" policy learns from it)."""
        self.waiting.observe_step(scheduler_output.total_num_scheduled_tokens, seconds)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                request.finish_reason = FinishReason.STOP
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.finish_reason = FinishReason.STOP
                request.stop_reason = token_id
                return True
        if request.num_output_tokens >= request.max_tokens:
            request.finish_reason = FinishReason.LENGTH
            return True
        return False

    # ---- introspection -------------------------------------------------------------------

    def statistics(self) -> EngineStats:
        """A frozen snapshot of the queues, the KV blocks and the prefix cache's hits."""
        kv, spec = self.kv_cache_manager, self.speculator
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_prefill_tokens=self.num_prefill_tokens,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            num_spec_turn_downs=spec.num_turn_downs if spec else 0,
            spec_drafts_per_position=tuple(spec.drafted_per_position) if spec else (),
            spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def _num_prefill(request: Request, num_new: int) -> int:
    """How many of the `num_new` tokens a step computes for `request` are prompt (or
    recomputed) tokens: every position before the prompt's end, and every position before the
    last token once it has outputs (a decode computes only that last one). A one-token prompt
    is one prefill token, not a decode."""
    start = request.num_computed_tokens
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    return max(0, min(start + num_new, prefill_end) - start)
