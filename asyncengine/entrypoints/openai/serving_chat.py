"""`POST /v1/chat/completions`: chat through the tokenizer's chat template, streamed or not.

request body → ChatCompletionRequest → messages → chat template (jinja2) → token ids →
run_prompts (one engine request, DELTA outputs) → `n` choices of assistant messages (with a
reasoning parser: thinking → `reasoning_content`, the rest → content and tool calls).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.entrypoints.openai.body import decode_request
from asyncengine.entrypoints.openai.chat_prompt import check_reasoning, render_prompt
from asyncengine.entrypoints.openai.errors import bad_request, error_for, from_value_error
from asyncengine.entrypoints.openai.generation import (
    EnginePrompt,
    OnOutput,
    check_request,
    created_now,
    new_request_id,
    run_prompts,
)
from asyncengine.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    sampling_params,
)
from asyncengine.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.entrypoints.openai.structured import (
    CONSTRAINED_STREAM_WAIT_S,
    constraint_error,
    request_constraint,
)
from asyncengine.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolRequest,
    parse_tool_calls,
    tool_request,
)
from asyncengine.entrypoints.sse import DONE, Emit, call_until_disconnect
from asyncengine.entrypoints.sse import event as _event
from asyncengine.entrypoints.sse_response import SSEResponse
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from asyncengine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_stream: ToolCallStream | None = None  # when tools may be called
    reasoning_stream: ReasoningStream | None = None  # with a reasoning parser


class ChatServing:
    def __init__(self, state: ServerState, reasoning_parser: ReasoningParser | None = None) -> None:
        self.state = state
        self.reasoning_parser = reasoning_parser

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, ChatCompletionRequest)
        lora = await state.lora_for(req.model)
        state.check_ready()
        tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        params = _params(req, tools, state.engine.config.model_config.sampling_defaults)
        prompt = self._prompt(req, tools)
        format_field = (
            "response_format"
            if req.response_format is not None and req.response_format.get("type") != "text"
            else None
        )
        check_reasoning(self.reasoning_parser, tools, params, prompt, format_field)
        # Every field is checked by now: a streamed request is refused before its stream.
        check_request(
            state, [prompt], params, req.priority or 0, "messages", _max_tokens_field(req)
        )
        run = _Run(
            state, req, params, prompt, new_request_id("chatcmpl"), arrival, tools,
            self.reasoning_parser, lora,
        )  # fmt: skip
        constrained = tools is not None and tools.choice != "auto"
        if req.stream:
            # A constrained request the engine refuses before its first token (a schema that
            # does not compile) gets its error status, not a stream; others start at once.

            def early_error(exc: Exception) -> Response:
                return error_for(constraint_error(exc, req, constrained)).response()

            return SSEResponse(
                run.stream,
                early_error=early_error if params.structured_outputs is not None else None,
                wait_s=CONSTRAINED_STREAM_WAIT_S,
            )
        try:
            body = await call_until_disconnect(request.receive, run.complete)
        except Exception as exc:
            raise error_for(constraint_error(exc, req, constrained)) from exc
        # None: the client went away and its request was aborted; nobody reads this.
        return Response(body or b"", media_type="application/json")

    def _prompt(self, req: ChatCompletionRequest, tools: ToolRequest | None) -> EnginePrompt:
        # Content parts are flattened here; render_chat checks the rest (empty list, roles).
        messages: list[dict[str, Any]] = []
        for i, message in enumerate(req.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"content parts of type {part.type!r} are not supported, only text",
                            f"messages[{i}].content",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            entry: dict[str, Any] = {"role": message.role, "content": content or ""}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_calls is not None:
                _check_tool_calls(message.tool_calls, f"messages[{i}].tool_calls")
                entry["tool_calls"] = message.tool_calls
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            messages.append(entry)
        return render_prompt(
            self.state.engine.tokenizer, messages, tools, req.chat_template_kwargs, "messages",
            add_generation_prompt=req.add_generation_prompt,
        )  # fmt: skip


def _check_tool_calls(calls: list[dict[str, Any]], param: str) -> None:
    """400 unless each of an assistant's earlier calls has OpenAI's shape (templates and the
    tool prompt read `function.name` and `function.arguments`)."""
    for j, call in enumerate(calls):
        fn = call.get("function")
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
            or not isinstance(fn.get("arguments", ""), (str, dict))
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id", ""), str)
        ):
            raise bad_request(
                f'{param}[{j}] must be {{"id": ..., "type": "function", "function": '
                f'{{"name": ..., "arguments": "<JSON text>"}}}}, not {call!r:.200}',
                param,
            )


def _params(
    req: ChatCompletionRequest,
    tools: ToolRequest | None,
    defaults: Iterable[tuple[str, float | int]],
) -> SamplingParams:
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        # max_completion_tokens wins, but a bad max_tokens beside it is still refused.
        try:
            SamplingParams(max_tokens=req.max_tokens)
        except ValueError as exc:
            raise from_value_error(exc) from None
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    constraint = request_constraint(req)
    tool_constraint = tools.constraint() if tools is not None else None
    if constraint is not None and tool_constraint is not None:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the output itself: "
            "give no response_format or structured_outputs with it",
            "tool_choice",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_name = _max_tokens_field(req)
    max_tokens = (
        req.max_completion_tokens if max_name == "max_completion_tokens" else req.max_tokens
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        return sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs=constraint or tool_constraint,
            defaults=defaults,
        )
    except ValueError as exc:
        raise from_value_error(exc, {"logprobs": "top_logprobs", "max_tokens": max_name}) from None


def _max_tokens_field(req: ChatCompletionRequest) -> str:
    """Which field holds the output budget: OpenAI's newer name wins over the older one."""
    return "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"


class _Run:
    """One chat request being generated: its choices, and how they are sent."""

    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        params: SamplingParams,
        prompt: EnginePrompt,
        request_id: str,
        arrival: float,
        tools: ToolRequest | None = None,
        reasoning_parser: ReasoningParser | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.state, self.req, self.params, self.prompt = state, req, params, prompt
        self.lora_request = lora_request
        # Responses name the model asked for: the served one, or the adapter.
        self.model = state.model_name if lora_request is None else lora_request.name
        self.request_id, self.arrival, self.created = request_id, arrival, created_now()
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self.choices = [
            _ChoiceState(
                tool_stream=ToolCallStream(tools) if tools is not None else None,
                reasoning_stream=(
                    reasoning_parser.stream(prompt.text) if reasoning_parser is not None else None
                ),
            )
            for _ in range(params.n)
        ]

    async def _generate(self, on_output: OnOutput) -> None:
        await run_prompts(
            self.state,
            [self.prompt],
            self.params,
            request_id=self.request_id,
            priority=self.req.priority or 0,
            arrival=self.arrival,
            on_output=on_output,
            lora_request=self.lora_request,
        )

    def _update(self, c: CompletionOutput) -> list[TokenLogprob] | None:
        """Fold a DELTA into its choice; the delta's logprobs, if asked for."""
        choice = self.choices[c.index]
        choice.text.append(c.text)
        choice.num_tokens += len(c.token_ids)
        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        if self.params.logprobs is None or c.logprobs is None:
            return None
        return _logprobs(c.token_ids, c.logprobs, self.params.logprobs)

    def _usage(self) -> Usage:
        prompt_tokens = len(self.prompt.token_ids)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    # ---- not streamed ------------------------------------------------------------------------

    async def complete(self) -> bytes:
        async def on_output(_: int, output: RequestOutput) -> None:
            for c in output.outputs:
                logprobs = self._update(c)
                if logprobs is not None:
                    choice = self.choices[c.index]
                    choice.logprobs = (choice.logprobs or []) + logprobs

        await self._generate(on_output)
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, c) for i, c in enumerate(self.choices)],
            usage=self._usage(),
        )
        return msgspec.json.encode(response)

    def _choice(self, index: int, c: _ChoiceState) -> ChatChoice:
        content: str | None = "".join(c.text)
        reasoning: str | None = None
        if self.reasoning_parser is not None and content is not None:
            # Tool calls are looked for in the answer only, never in the thinking.
            reasoning, content = self.reasoning_parser.extract(content, self.prompt.text)
        calls: list[ToolCall] = []
        finish_reason = c.finish_reason
        if self.tools is not None and finish_reason == "stop" and content is not None:
            content, parsed = parse_tool_calls(content, self.tools)
            calls = [
                ToolCall(id=p.id, function=FunctionCall(name=p.name, arguments=p.arguments))
                for p in parsed
            ]
            if calls:
                finish_reason = "tool_calls"
        return ChatChoice(
            index=index,
            message=AssistantMessage(
                content=content,
                tool_calls=calls or None,
                reasoning_content=reasoning,
                reasoning=reasoning,
            ),
            logprobs=(
                ChatLogprobs(content=c.logprobs or []) if self.params.logprobs is not None else None
            ),
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
        )

    # ---- streamed ----------------------------------------------------------------------------

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None) -> bytes:
        return _event(
            ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def _delta(self, c: CompletionOutput) -> DeltaMessage:
        """The message delta of a DELTA output: its text, split into thinking and answer by
        the reasoning parser, the answer's part as tool calling makes of it."""
        choice = self.choices[c.index]
        reasoning, text = "", c.text
        if choice.reasoning_stream is not None:
            reasoning, text = choice.reasoning_stream.feed(c.text)
            if c.finish_reason is not None:
                more_reasoning, more_text = choice.reasoning_stream.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        tool_stream = choice.tool_stream
        calls: list[DeltaToolCall] = []
        if tool_stream is None:
            content = text
        else:
            content, calls = tool_stream.feed(text) if text else ("", [])
            if c.finish_reason is not None:
                more_content, more_calls = tool_stream.finish()
                content, calls = content + more_content, calls + more_calls
        return DeltaMessage(
            content=content or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=calls or None,
        )

    async def stream(self, emit: Emit) -> None:
        continuous_usage = self.req.continuous_usage
        opened = False

        async def open_choices() -> None:
            # OpenAI opens every choice with its role, before any content: sent with the
            # first output, so that a request refused before it gets an error status instead.
            nonlocal opened
            opened = True
            usage = self._usage() if continuous_usage else None
            for i in range(self.params.n):
                role = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                await emit(self._chunk([role], usage))

        async def on_output(_: int, output: RequestOutput) -> None:
            if not opened:
                await open_choices()
            for c in output.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                logprobs = self._update(c)
                choice = ChatChunkChoice(
                    index=c.index,
                    delta=self._delta(c),
                    logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                tool_stream = self.choices[c.index].tool_stream
                if tool_stream is not None and c.finish_reason == "stop" and tool_stream.calls:
                    choice.finish_reason = "tool_calls"
                await emit(self._chunk([choice], self._usage() if continuous_usage else None))

        try:
            await self._generate(on_output)
            if not opened:
                await open_choices()
            if self.req.include_usage:
                await emit(self._chunk([], self._usage()))
        except Exception as exc:
            if not opened and self.params.structured_outputs is not None:
                raise  # nothing sent yet: the response is this error (SSEResponse.early_error)
            if not opened:
                await open_choices()
            await emit(_event(error_for(exc).body()))  # the status is out: an event
        await emit(DONE)


def _logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], top_n: int
) -> list[TokenLogprob]:
    """OpenAI's chat logprobs: each sampled token, with the `top_n` most likely in rank order."""
    result = []
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position.get(token_id) or next(iter(position.values()))
        top = sorted((lp for lp in position.values() if lp.rank <= top_n), key=lambda lp: lp.rank)
        result.append(
            TokenLogprob(
                token=sampled.decoded_token or "",
                logprob=sampled.logprob,
                bytes=list((sampled.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in top
                ],
            )
        )
    return result
