"""`POST /v1/completions`: OpenAI's (legacy) text completions, streamed or not.

request body → CompletionRequest → SamplingParams + one EnginePrompt per prompt →
run_prompts (one engine request each, DELTA outputs) → choices, indexed prompt * n + sequence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.entrypoints.openai.body import decode_request
from asyncengine.entrypoints.openai.errors import bad_request, error_for, from_value_error
from asyncengine.entrypoints.openai.generation import (
    EnginePrompt,
    OnOutput,
    check_request,
    created_now,
    engine_prompts,
    new_request_id,
    run_prompts,
)
from asyncengine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    sampling_params,
)
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.entrypoints.openai.structured import (
    CONSTRAINED_STREAM_WAIT_S,
    constraint_error,
    request_constraint,
)
from asyncengine.entrypoints.sse import DONE, Emit, call_until_disconnect
from asyncengine.entrypoints.sse import event as _event
from asyncengine.entrypoints.sse_response import SSEResponse
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from asyncengine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class _ChoiceState:
    """One choice as the server has sent or gathered it so far."""

    prefix: str  # the echoed prompt, sent with the choice's first text
    text: list[str] = field(default_factory=list)
    text_len: int = 0  # for logprobs' text_offset
    num_tokens: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, CompletionRequest)
        lora = await state.lora_for(req.model)
        state.check_ready()
        params = _params(req, state.engine.config.model_config.sampling_defaults)
        prompts = self._prompts(req, params)
        # Every field is checked by now: a streamed request is refused before its stream.
        run = _Run(state, req, params, prompts, new_request_id("cmpl"), arrival, lora)
        if req.stream:
            # A constrained request the engine refuses before its first token (a schema that
            # does not compile) gets its error status, not a stream; others start at once.
            if params.structured_outputs is None:
                return SSEResponse(run.stream)
            return SSEResponse(
                run.stream,
                early_error=lambda exc: error_for(constraint_error(exc, req, False)).response(),
                wait_s=CONSTRAINED_STREAM_WAIT_S,
            )
        try:
            body = await call_until_disconnect(request.receive, run.complete)
        except Exception as exc:
            raise error_for(constraint_error(exc, req, False)) from exc
        # None: the client went away and its requests were aborted; nobody reads this.
        return Response(body or b"", media_type="application/json")

    def _prompts(self, req: CompletionRequest, params: SamplingParams) -> list[EnginePrompt]:
        tokenizer = self.state.engine.tokenizer
        prompts = engine_prompts(req.prompt, tokenizer, "prompt")
        check_request(self.state, prompts, params, req.priority or 0, "prompt")
        for p in prompts:
            if req.echo and p.text is None:
                p.text = tokenizer.decode(p.token_ids, skip_special_tokens=False)
        return prompts


def _params(req: CompletionRequest, defaults: Iterable[tuple[str, float | int]]) -> SamplingParams:
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of is not supported, other than equal to n", "best_of")
    constraint = request_constraint(req)
    try:
        return sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs,
            structured_outputs=constraint,
            defaults=defaults,
            # echo with logprobs: the prompt's tokens come with theirs, as OpenAI's do.
            prompt_logprobs=req.logprobs if req.echo else None,
        )
    except ValueError as exc:
        raise from_value_error(exc) from None


class _Run:
    """One completion request being generated: its choices, and how they are sent."""

    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest,
        params: SamplingParams,
        prompts: list[EnginePrompt],
        request_id: str,
        arrival: float,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.state, self.req, self.params, self.prompts = state, req, params, prompts
        self.lora_request = lora_request
        # Responses name the model asked for: the served one, or the adapter.
        self.model = state.model_name if lora_request is None else lora_request.name
        self.request_id, self.arrival, self.created = request_id, arrival, created_now()
        echoed = [(p.text or "") if req.echo else "" for p in prompts]
        self.choices = [_ChoiceState(prefix) for prefix in echoed for _ in range(params.n)]
        # Per prompt, its prompt logprobs (echo with logprobs), from the output carrying them.
        self.prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)

    async def _generate(self, on_output: OnOutput) -> None:
        await run_prompts(
            self.state,
            self.prompts,
            self.params,
            request_id=self.request_id,
            priority=self.req.priority or 0,
            arrival=self.arrival,
            on_output=on_output,
            lora_request=self.lora_request,
        )

    def _update(
        self, prompt_index: int, output: RequestOutput, c: CompletionOutput
    ) -> CompletionChoice:
        """Fold a DELTA into its choice; the choice as a chunk holding just that delta (and,
        with its first text, the echoed prompt: with logprobs, the prompt's too)."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        index = prompt_index * self.params.n + c.index
        choice = self.choices[index]
        text, offset = c.text, choice.text_len
        echoed = None
        if choice.prefix:
            positions = self.prompt_logprobs[prompt_index]
            if self.params.logprobs is not None and positions is not None:
                echoed = self._echoed_logprobs(prompt_index, positions)
            offset += len(choice.prefix)
            text, choice.prefix = choice.prefix + text, ""
        logprobs = None
        if self.params.logprobs is not None and c.logprobs is not None:
            logprobs = _logprobs(c.token_ids, c.logprobs, self.params.logprobs, offset)
        if echoed is not None:
            logprobs = echoed if logprobs is None else _extend(echoed, logprobs)
        choice.text.append(text)
        choice.text_len += len(text)
        choice.num_tokens += len(c.token_ids)
        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _echoed_logprobs(
        self, prompt_index: int, positions: list[PositionLogprobs | None]
    ) -> CompletionLogprobs:
        """The echoed prompt's logprobs: its first token has none (null, as OpenAI's)."""
        assert self.params.logprobs is not None
        token_ids = self.prompts[prompt_index].token_ids
        first = self.state.engine.tokenizer.decode(token_ids[:1], skip_special_tokens=False)
        result = CompletionLogprobs(
            tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
        )
        rest = cast("list[PositionLogprobs]", positions[1:])
        return _extend(result, _logprobs(token_ids[1:], rest, self.params.logprobs, len(first)))

    def _usage(self) -> Usage:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
        )

    # ---- not streamed ------------------------------------------------------------------------

    async def complete(self) -> bytes:
        async def on_output(prompt_index: int, output: RequestOutput) -> None:
            for c in output.outputs:
                delta = self._update(prompt_index, output, c)
                choice = self.choices[delta.index]
                if delta.logprobs is not None:
                    choice.logprobs = _extend(choice.logprobs, delta.logprobs)

        await self._generate(on_output)
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text="".join(c.text),
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(self.choices)
            ],
            usage=self._usage(),
        )
        return msgspec.json.encode(response)

    # ---- streamed ----------------------------------------------------------------------------

    async def stream(self, emit: Emit) -> None:
        continuous_usage = self.req.continuous_usage
        sent = False  # whether anything went out (then an error can only be an event)

        async def on_output(prompt_index: int, output: RequestOutput) -> None:
            nonlocal sent
            for c in output.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                choice = self._update(prompt_index, output, c)
                chunk = CompletionResponse(
                    id=self.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[choice],
                    usage=self._usage() if continuous_usage else None,
                )
                sent = True
                await emit(_event(chunk))

        try:
            await self._generate(on_output)
            if self.req.include_usage:
                final = CompletionResponse(
                    id=self.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=self._usage(),
                )
                await emit(_event(final))
        except Exception as exc:
            if not sent and self.params.structured_outputs is not None:
                raise  # nothing sent yet: the response is this error (SSEResponse.early_error)
            await emit(_event(error_for(exc).body()))  # the status is out: an event
        await emit(DONE)


def _logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], top_n: int, text_offset: int
) -> CompletionLogprobs:
    """OpenAI's completions logprobs: each sampled token, its logprob, the top `top_n` (and
    the sampled token) by text, and where each token starts in the choice's text."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position.get(token_id) or next(iter(position.values()))
        text = sampled.decoded_token or ""
        result.tokens.append(text)
        result.token_logprobs.append(sampled.logprob)
        # Keyed by text: where tokens decode alike, the sampled one's entry stays, then the
        # more likely one's.
        top: dict[str, float] = {text: sampled.logprob}
        for lp in sorted(position.values(), key=lambda lp: lp.rank):
            if lp.rank <= top_n:
                top.setdefault(lp.decoded_token or "", lp.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def _extend(into: CompletionLogprobs | None, more: CompletionLogprobs) -> CompletionLogprobs:
    if into is None:
        return more
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset
    return into
