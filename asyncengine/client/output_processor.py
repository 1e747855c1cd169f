"""OutputProcessor: EngineCoreOutputs → RequestOutput, per request and output kind.

It detokenises incrementally, applies stop strings (asking the core to abort a request whose
text hit one), gathers the `n` sequences of a request, and shapes each output as CUMULATIVE,
DELTA or FINAL_ONLY.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncengine.client.detokenizer import IncrementalDetokenizer
from asyncengine.client.input_processor import ProcessedRequest
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.errors import EngineGenerateError, InvalidRequestError
from asyncengine.ipc.messages import EngineCoreOutput, EngineCoreOutputs, LogprobsEntry
from asyncengine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from asyncengine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True, eq=False)
class SequenceState:
    """One of a request's `n` sequences; `core_id` names it in the engine core."""

    index: int
    core_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0  # DELTA bookkeeping: what earlier outputs already carried
    sent_num_tokens: int = 0


@dataclass(slots=True, eq=False)
class RequestState:
    """A user request as the client tracks it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    queued: bool = True  # no output from the core yet: waiting, or in its prefill
    # SamplingParams.prompt_logprobs: filled by position as the prefill chunks report them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them
    embedding: list[float] | None = None  # an embedding request's pooled vector, at its end

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Sequences the core must drop: they hit a stop string, or their request failed.
    core_ids_to_abort: list[str]
    # Requests whose processing raised, with the error for their stream; forgotten here.
    failed: list[tuple[str, EngineGenerateError]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._sequences: dict[str, tuple[RequestState, SequenceState]] = {}  # by core id
        self.num_queued = 0  # requests with no output from the core yet (see RequestState)

    def add_request(self, request: ProcessedRequest) -> None:
        """Track a request whose sequences the core is about to run; ValueError for an id
        that is live already."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        state = self._new_request_state(request)
        self.requests[state.request_id] = state
        self.num_queued += 1
        for seq in state.sequences:
            self._sequences[seq.core_id] = (state, seq)

    def _new_request_state(self, request: ProcessedRequest) -> RequestState:
        params, prompt_token_ids = request.params, request.prompt_token_ids
        sequences = [
            SequenceState(
                index=i,
                core_id=core_request.request_id,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i, core_request in enumerate(request.core_requests)
        ]
        metrics = RequestMetrics(
            arrival_time=request.core_requests[0].arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
        )
        state = RequestState(
            request.request_id, request.prompt, prompt_token_ids, params, sequences, metrics
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests; returns the core ids of their sequences still running."""
        core_ids: list[str] = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            self._dequeue(state)
            for seq in state.sequences:
                if self._sequences.pop(seq.core_id, None) is not None:
                    core_ids.append(seq.core_id)
        return core_ids

    def make_abort_output(self, request_id: str) -> RequestOutput | None:
        """The final output of a request about to be aborted (call before abort_requests):
        its unfinished sequences end with finish_reason "abort"."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._make_output(state, state.sequences, finished=True)

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Fold one step's outputs in. A request whose processing raises (detokenisation,
        stop strings, logprobs) fails alone: it is forgotten, its running sequences are to be
        aborted, and it is reported in `failed`; every other request goes on."""
        now = time.monotonic()
        touched: dict[str, tuple[RequestState, list[SequenceState]]] = {}
        to_abort: list[str] = []
        failed: list[tuple[str, EngineGenerateError]] = []
        for out in outputs.outputs:
            entry = self._sequences.get(out.request_id)
            if entry is None:
                continue  # aborted by the client meanwhile, or failed
            state, seq = entry
            try:
                stopped = self._apply(state, seq, out, now)
            except Exception as exc:
                failed.append((state.request_id, self._failure(state, exc)))
                to_abort.extend(self.abort_requests([state.request_id]))
                touched.pop(state.request_id, None)
                continue
            if stopped:
                to_abort.append(seq.core_id)
            if seq.finish_reason is not None:
                del self._sequences[seq.core_id]
            elif not out.new_token_ids:
                continue  # a prefill chunk's prompt logprobs: reported with the first token
            touched.setdefault(state.request_id, (state, []))[1].append(seq)

        request_outputs: list[RequestOutput] = []
        for state, changed in touched.values():
            self._dequeue(state)
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            try:
                request_output = self._make_output(state, changed, finished)
            except Exception as exc:
                failed.append((state.request_id, self._failure(state, exc)))
                to_abort.extend(self.abort_requests([state.request_id]))
                continue
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, to_abort, failed)

    @staticmethod
    def _failure(state: RequestState, exc: Exception) -> EngineGenerateError:
        if isinstance(exc, InvalidRequestError):  # the core found it invalid
            return InvalidRequestError(f"request {state.request_id!r} is invalid: {exc}")
        if isinstance(exc, EngineGenerateError):  # the core failed it
            return EngineGenerateError(f"request {state.request_id!r} failed in the engine: {exc}")
        error = EngineGenerateError(
            f"request {state.request_id!r} failed while its output was processed: "
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error

    def _dequeue(self, state: RequestState) -> None:
        if state.queued:
            state.queued = False
            self.num_queued -= 1

    def _apply(
        self, state: RequestState, seq: SequenceState, out: EngineCoreOutput, now: float
    ) -> bool:
        """Fold one core output into `seq`; True when a stop string ended it here.
        Raises EngineGenerateError for a request the core failed."""
        if out.error is not None:
            raise (InvalidRequestError if out.bad_request else EngineGenerateError)(out.error)
        metrics = state.metrics
        if metrics.first_token_time is None and out.new_token_ids:
            metrics.first_token_time = now
            metrics.num_cached_tokens = out.num_cached_tokens
        metrics.last_token_time = now
        metrics.num_generation_tokens += len(out.new_token_ids)
        seq.token_ids.extend(out.new_token_ids)
        if out.pooled is not None:
            state.embedding = out.pooled
        if state.prompt_logprobs is not None and out.new_prompt_logprobs is not None:
            first, entries = out.new_prompt_logprobs
            for offset, entry in enumerate(entries):
                # By position: a preempted request that recomputes its prompt rewrites them.
                state.prompt_logprobs[first + offset] = self._decode_logprobs(entry)
        if seq.logprobs is not None and out.new_logprobs:
            seq.logprobs.extend(self._decode_logprobs(e) for e in out.new_logprobs)
        stop_str = seq.detokenizer.update(out.new_token_ids)
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
            return out.finish_reason is None  # the core still runs it
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = str(out.finish_reason), out.stop_reason
        return False

    def _decode_logprobs(self, entry: LogprobsEntry) -> PositionLogprobs:
        token_ids, logprobs, sampled_rank = entry
        result: PositionLogprobs = {}
        for pos, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            if token_id in result:
                continue
            rank = sampled_rank if pos == 0 else pos
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            result[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=text)
        return result

    def _make_output(
        self, state: RequestState, changed: list[SequenceState], finished: bool
    ) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [self._completion(s, delta=False) for s in state.sequences]
        elif kind == RequestOutputKind.DELTA:
            completions = [self._completion(s, delta=True) for s in changed]
        else:
            completions = [self._completion(s, delta=False) for s in state.sequences]
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            if kind == RequestOutputKind.DELTA and state.prompt_logprobs_sent:
                prompt_logprobs = None
            else:
                state.prompt_logprobs_sent = True
                prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            embedding=state.embedding,
        )

    @staticmethod
    def _completion(seq: SequenceState, delta: bool) -> CompletionOutput:
        text = seq.detokenizer.visible_text(seq.finish_reason is not None)
        token_ids, logprobs = seq.token_ids, seq.logprobs
        if delta:
            text_start, tok_start = seq.sent_text_len, seq.sent_num_tokens
            seq.sent_text_len, seq.sent_num_tokens = len(text), len(token_ids)
            text, token_ids = text[text_start:], token_ids[tok_start:]
            logprobs = logprobs[tok_start:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
        )
