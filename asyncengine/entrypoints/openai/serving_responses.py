"""`POST /v1/responses`: OpenAI's Responses API, stateless, over the chat machinery.

request body → ResponsesRequest → `instructions` and `input` items as chat messages (message
items, `function_call` items as an assistant's tool calls, `function_call_output` items as
tool messages) → the chat template (with the tools, as chat renders them) → one engine request
→ output items: a `reasoning` item (with a reasoning parser), a `message` item with
`output_text`, `function_call` items. Streamed, the same items arrive as Responses events
(`response.created` ... `response.completed`), each with its `sequence_number`.

Both ways run the same code: each DELTA output is split into thinking and answer
(`ReasoningStream`), the answer into text and calls (`ToolCallStream`), and the pieces open,
extend and close output items; a non-streamed response is the items a stream would end with.

Nothing is stored: `store` is accepted and ignored (the response says `"store": false`), and
`previous_response_id`, `conversation`, `background` and prompt templates are refused.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.entrypoints.openai.body import decode_request
from asyncengine.entrypoints.openai.chat_prompt import check_reasoning, render_prompt
from asyncengine.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    error_for,
    from_value_error,
)
from asyncengine.entrypoints.openai.generation import (
    EnginePrompt,
    check_request,
    run_prompts,
)
from asyncengine.entrypoints.openai.protocol import (
    DeltaToolCall,
    _SamplingRequest,
    sampling_params,
)
from asyncengine.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.entrypoints.openai.structured import CONSTRAINED_STREAM_WAIT_S, request_constraint
from asyncengine.entrypoints.openai.tool_calls import (
    TOOL_CHOICES,
    ToolCallStream,
    ToolRequest,
    tool_request,
)
from asyncengine.entrypoints.sse import Emit, call_until_disconnect
from asyncengine.entrypoints.sse_response import SSEResponse
from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import SamplingParams, StructuredOutputsParams

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_TEXT_FORMATS = ("text", "json_object", "json_schema")
_CLIENT_PREFIX = re.compile(r"^request '[^']*' is invalid: ")
_encoder = msgspec.json.Encoder()


class ResponsesRequest(_SamplingRequest, kw_only=True):
    """OpenAI's Responses body. vLLM's sampling extensions (`top_k`, `seed`, `ignore_eos`,
    `structured_outputs`, ...) come with `_SamplingRequest`; unknown fields are ignored."""

    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    # Accepted and ignored: nothing is stored (the response says "store": false).
    store: bool | None = None
    # Refused: they need stored state or work beyond one generation.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    # vLLM's extension for the chat template (`{"enable_thinking": false}`)
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesServing:
    def __init__(self, state: ServerState, reasoning_parser: ReasoningParser | None = None) -> None:
        self.state = state
        self.reasoning_parser = reasoning_parser

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, ResponsesRequest)
        state.check_model(req.model)
        state.check_ready()
        _check_unsupported(req)
        tools = _tool_request(req)
        text_constraint, text_format = _text_format(req.text)
        params = _params(
            req, tools, text_constraint, state.engine.config.model_config.sampling_defaults
        )
        prompt = self._prompt(req, tools)
        format_field = "text.format" if text_constraint is not None else None
        check_reasoning(self.reasoning_parser, tools, params, prompt, format_field)
        check_request(
            state, [prompt], params, req.priority or 0, "input", "max_output_tokens"
        )  # every field is checked by now: a streamed request is refused before its stream
        run = _Run(state, req, params, prompt, arrival, tools, text_format, self.reasoning_parser)
        source = _constraint_source(req, tools, text_constraint)

        def refusal(exc: Exception) -> OpenAIError:
            return error_for(_constraint_error(exc, source))

        if req.stream:
            return SSEResponse(
                run.stream,
                early_error=(
                    (lambda exc: refusal(exc).response())
                    if params.structured_outputs is not None
                    else None
                ),
                wait_s=CONSTRAINED_STREAM_WAIT_S,
            )
        try:
            body = await call_until_disconnect(request.receive, run.complete)
        except Exception as exc:
            raise refusal(exc) from exc
        # None: the client went away and its request was aborted; nobody reads this.
        return Response(body or b"", media_type="application/json")

    def _prompt(self, req: ResponsesRequest, tools: ToolRequest | None) -> EnginePrompt:
        messages = _messages(req)
        return render_prompt(
            self.state.engine.tokenizer, messages, tools, req.chat_template_kwargs, "input"
        )


# ---- the request -----------------------------------------------------------------------------


def _check_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses. Send the "
            "whole conversation in `input` (earlier output items included)",
            "previous_response_id",
        )
    if req.conversation is not None:
        raise bad_request(
            "conversation is not supported: this server stores no conversations. Send the "
            "whole conversation in `input`",
            "conversation",
        )
    if req.background:
        raise bad_request("background mode is not supported", "background")
    if req.prompt is not None:
        raise bad_request("prompt templates (`prompt`) are not supported", "prompt")
    if req.truncation not in (None, "disabled"):
        raise bad_request(
            f"truncation={req.truncation!r} is not supported: only 'disabled' (an input over "
            "the context length is a 400)",
            "truncation",
        )
    if req.n not in (None, 1):
        raise bad_request("n is not supported: a response has one output", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.response_format is not None:
        raise bad_request(
            "response_format is chat's: the Responses API takes `text.format`", "response_format"
        )
    if req.top_logprobs is not None:
        raise bad_request("top_logprobs is not supported", "top_logprobs")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages; 400 naming the bad item."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if not req.input:
            raise bad_request("input is an empty string", "input")
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise bad_request("input is an empty list: give at least one item", "input")
    call_names: dict[str, str] = {}
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(
                f"{param} must be an object (a message, function_call or function_call_output "
                f"item), not {type(item).__name__}",
                param,
            )
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call_id = _string(item, "call_id", param)
            name = _string(item, "name", param)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise bad_request(f"{param}.arguments must be a string (JSON text)", param)
            call_names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn's calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            output = _text(item.get("output"), f"{param}.output")
            tool_message = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in call_names:
                tool_message["name"] = call_names[call_id]
            messages.append(tool_message)
        elif kind == "reasoning":
            continue  # an earlier turn's thinking, sent back: templates drop it too
        elif kind == "item_reference":
            raise bad_request(
                f"{param}: item references are not supported, this server stores no items",
                f"{param}.type",
            )
        else:
            raise bad_request(
                f"{param}.type={kind!r} is not supported: give message, function_call, "
                "function_call_output or reasoning items",
                f"{param}.type",
            )
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(
            f"{param}.role={role!r} is invalid: must be one of {', '.join(_ROLES)}",
            f"{param}.role",
        )
    return {"role": _ROLES[role], "content": _text(item.get("content"), f"{param}.content")}


def _text(content: object, param: str) -> str:
    """A message's content (or a tool's output): a string, or a list of input_text /
    output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{param} must be a string or a list of input_text parts, not {type(content).__name__}",
            param,
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"{param}[{j}] of type {kind!r} is not supported: only input_text and "
                "output_text parts (images, files and audio are not supported)",
                f"{param}[{j}]",
            )
        assert isinstance(part, dict)
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string", f"{param}.{key}")
    return value


def _tool_request(req: ResponsesRequest) -> ToolRequest | None:
    """The Responses tools (`{"type": "function", "name", "description", "parameters"}`)
    and tool_choice, checked, as chat's ToolRequest."""
    chat_tools: list[Any] | None = None
    names: list[str] = []
    if req.tools is not None:
        chat_tools = []
        for i, tool in enumerate(req.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or kind != "function":
                raise bad_request(
                    f"tools[{i}] of type {kind!r} is not supported: only function tools "
                    '({"type": "function", "name": ..., "parameters": {...}}); built-in tools '
                    "(web search, file search, ...) are not available on this server",
                    "tools",
                )
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise bad_request(f"tools[{i}].parameters must be a JSON schema object", "tools")
            description = tool.get("description")
            if description is not None and not isinstance(description, str):
                raise bad_request(f"tools[{i}].description must be a string", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            chat_tools.append({"type": "function", "function": fn})
            names.append(name)
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str) or name not in names:
            raise bad_request(
                f"tool_choice names no function of tools: {choice!r:.200}; allowed are "
                f'{", ".join(TOOL_CHOICES)} or {{"type": "function", "name": one of {names}}}',
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": name}}
    elif choice is not None and choice not in TOOL_CHOICES:
        raise bad_request(
            f"tool_choice={choice!r:.200} is invalid: must be one of {', '.join(TOOL_CHOICES)} "
            'or {"type": "function", "name": ...}',
            "tool_choice",
        )
    return tool_request(chat_tools, choice, req.parallel_tool_calls)


def _text_format(text: dict[str, Any] | None) -> tuple[StructuredOutputsParams | None, Any]:
    """`text.format` as a constraint, and the format to echo in the response."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None, {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in _TEXT_FORMATS:
        raise bad_request(
            f"text.format={fmt!r:.200} is invalid: its type must be one of "
            f"{', '.join(_TEXT_FORMATS)}",
            "text.format",
        )
    if kind == "text":
        return None, fmt
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), fmt
    schema = fmt.get("schema")
    if not isinstance(fmt.get("name"), str) or not isinstance(schema, dict):
        raise bad_request(
            'text.format of type json_schema needs {"name": ..., "schema": {...}}', "text.format"
        )
    try:
        return StructuredOutputsParams(json=schema), fmt
    except ValueError as exc:
        raise bad_request(f"text.format.schema is invalid: {exc}", "text.format") from None


def _params(
    req: ResponsesRequest,
    tools: ToolRequest | None,
    text_constraint: StructuredOutputsParams | None,
    defaults: Iterable[tuple[str, float | int]],
) -> SamplingParams:
    extension = request_constraint(req)  # vLLM's structured_outputs (response_format: refused)
    if text_constraint is not None and extension is not None:
        raise bad_request("give text.format or structured_outputs, not both", "structured_outputs")
    constraint = text_constraint or extension
    tool_constraint = tools.constraint() if tools is not None else None
    if constraint is not None and tool_constraint is not None:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the output itself: "
            "give no text.format or structured_outputs with it",
            "tool_choice",
        )
    try:
        return sampling_params(
            req,
            max_tokens=req.max_output_tokens,
            logprobs=None,
            structured_outputs=constraint or tool_constraint,
            defaults=defaults,
        )
    except ValueError as exc:
        raise from_value_error(exc, {"max_tokens": "max_output_tokens"}) from None


def _constraint_source(
    req: ResponsesRequest,
    tools: ToolRequest | None,
    text_constraint: StructuredOutputsParams | None,
) -> tuple[str, str] | None:
    """(param, how the schema is named) of the request's constraint, if any."""
    if text_constraint is not None:
        return "text.format", "text.format.schema"
    if req.structured_outputs is not None:
        return "structured_outputs", "structured_outputs.json"
    if tools is not None and tools.constraint() is not None:
        return "tools", "a schema of tools[].parameters"
    return None


def _constraint_error(exc: Exception, source: tuple[str, str] | None) -> Exception:
    """The 400 for a constraint the engine could not compile, naming where it came from."""
    if not isinstance(exc, InvalidRequestError):
        return exc
    message = _CLIENT_PREFIX.sub("", str(exc))
    if source is None:
        return bad_request(message)
    param, place = source
    return bad_request(message.replace("structured_outputs.json ", f"{place} "), param)


# ---- the output ------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True, eq=False)
class _Item:
    """An output item being written: its events are sent as it grows."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    output_index: int
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def body(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
            return {
                "id": self.id, "type": "reasoning", "summary": [], "content": content,
                "status": status,
            }  # fmt: skip
        if self.kind == "message":
            parts = [_output_text(text)] if status != "in_progress" else []
            return {
                "id": self.id, "type": "message", "role": "assistant", "content": parts,
                "status": status,
            }  # fmt: skip
        return {
            "id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
            "arguments": text if status != "in_progress" else "", "status": status,
        }  # fmt: skip


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Output:
    """One response's output items, built from DELTA outputs; `events` are the Responses
    events that built them (without sequence numbers), taken as they come."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning_stream = reasoning
        self.tool_stream = tools
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: _Item | None = None
        self.events: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def feed(self, c: CompletionOutput) -> None:
        self.num_tokens += len(c.token_ids)
        finished = c.finish_reason is not None
        reasoning, text = "", c.text
        stream = self.reasoning_stream
        if stream is not None:
            reasoning, text = stream.feed(c.text)
            if finished:
                more_reasoning, more_text = stream.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning or (not text and stream.in_reasoning):
                self.reasoning_tokens += len(c.token_ids)  # (a delta's tokens, roughly)
        if reasoning:
            self._add("reasoning", reasoning)
        calls: list[DeltaToolCall] = []
        content = text
        if self.tool_stream is not None:
            content, calls = self.tool_stream.feed(text) if text else ("", [])
            if finished:
                more_content, more_calls = self.tool_stream.finish()
                content, calls = content + more_content, calls + more_calls
        if content:
            self._add("message", content)
        for call in calls:
            if call.id is not None:
                self._open("function_call", call.id, call.function.name or "")
            if call.function.arguments:
                self._add("function_call", call.function.arguments)
        if finished:
            self.finish_reason = c.finish_reason
            if not self.items and self.open is None:
                self._open("message")  # no output at all: an empty message still
            self._close("incomplete" if c.finish_reason == "length" else "completed")

    def _open(self, kind: str, call_id: str = "", name: str = "") -> _Item:
        self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, _new_id(prefix), len(self.items), call_id=call_id, name=name)
        self.open = item
        self.events.append(
            {
                "type": "response.output_item.added",
                "output_index": item.output_index,
                "item": item.body("in_progress"),
            }
        )
        part = None
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            part = _output_text("")
        if part is not None:
            self.events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item.id,
                    "output_index": item.output_index,
                    "content_index": 0,
                    "part": part,
                }
            )
        return item

    def _add(self, kind: str, delta: str) -> None:
        item = self.open
        if item is None or item.kind != kind:
            item = self._open(kind)
        item.text.append(delta)
        where = {"item_id": item.id, "output_index": item.output_index}
        if kind == "reasoning":
            event = {"type": "response.reasoning_text.delta", **where, "content_index": 0}
        elif kind == "message":
            event = {"type": "response.output_text.delta", **where, "content_index": 0}
            event["logprobs"] = []
        else:
            event = {"type": "response.function_call_arguments.delta", **where}
        event["delta"] = delta
        self.events.append(event)

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        body = item.body(status)
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "reasoning":
            part = body["content"][0]
            self.events.append(
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
            )
        elif item.kind == "message":
            part = body["content"][0]
            done = {"type": "response.output_text.done", **where, "content_index": 0}
            self.events.append({**done, "text": text, "logprobs": []})
        else:
            part = None
            self.events.append(
                {"type": "response.function_call_arguments.done", **where, "arguments": text}
            )
        if part is not None:
            self.events.append(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
            )
        self.events.append(
            {"type": "response.output_item.done", "output_index": item.output_index, "item": body}
        )
        self.items.append(body)


class _Run:
    """One response being generated, and how it is sent."""

    def __init__(
        self,
        state: ServerState,
        req: ResponsesRequest,
        params: SamplingParams,
        prompt: EnginePrompt,
        arrival: float,
        tools: ToolRequest | None,
        text_format: Any,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.state, self.req, self.params, self.prompt = state, req, params, prompt
        self.arrival, self.tools, self.text_format = arrival, tools, text_format
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output = _Output(
            reasoning_parser.stream(prompt.text) if reasoning_parser is not None else None,
            ToolCallStream(tools) if tools is not None else None,
        )

    async def _generate(self, on_event: Callable[[], Awaitable[None]] | None) -> None:
        async def on_output(_: int, output: RequestOutput) -> None:
            if output.metrics is not None:
                self.output.cached_tokens = output.metrics.num_cached_tokens
            for c in output.outputs:
                self.output.feed(c)
            if on_event is not None:
                await on_event()

        await run_prompts(
            self.state,
            [self.prompt],
            self.params,
            request_id=self.id,
            priority=self.req.priority or 0,
            arrival=self.arrival,
            on_output=on_output,
        )

    def _response(self, status: str, error: OpenAIError | None = None) -> dict[str, Any]:
        req, params, out = self.req, self.params, self.output
        done = status not in ("in_progress", "failed")
        usage = None
        if done:
            input_tokens = len(self.prompt.token_ids)
            usage = {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": out.cached_tokens},
                "output_tokens": out.num_tokens,
                "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
                "total_tokens": input_tokens + out.num_tokens,
            }
        tool_choice = req.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if req.tools else "none"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": (
                {"code": str(error.status), "message": error.message} if error is not None else None
            ),
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.model_name,
            "output": out.items if done else [],
            "parallel_tool_calls": (
                req.parallel_tool_calls if req.parallel_tool_calls is not None else True
            ),
            "previous_response_id": None,
            "reasoning": req.reasoning,
            "store": False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": self.text_format},
            "tool_choice": tool_choice,
            "tools": req.tools or [],
            "truncation": "disabled",
            "background": False,
            "metadata": req.metadata or {},
            "usage": usage,
        }

    def _final_status(self) -> str:
        reason = self.output.finish_reason
        if reason == "length":
            return "incomplete"
        return "cancelled" if reason == "abort" else "completed"

    async def complete(self) -> bytes:
        await self._generate(None)
        return _encoder.encode(self._response(self._final_status()))

    async def stream(self, emit: Emit) -> None:
        sequence_number = 0
        opened = False

        async def send(event: dict[str, Any]) -> None:
            nonlocal sequence_number
            event["sequence_number"] = sequence_number
            sequence_number += 1
            kind = event["type"].encode()
            await emit(b"event: " + kind + b"\ndata: " + _encoder.encode(event) + b"\n\n")

        async def open_stream() -> None:
            # Sent with the first output, so that a request refused before it (a constraint
            # that does not compile) gets an error status instead of a stream.
            nonlocal opened
            opened = True
            for kind in ("response.created", "response.in_progress"):
                await send({"type": kind, "response": self._response("in_progress")})

        async def on_event() -> None:
            if not opened:
                await open_stream()
            for event in self.output.take_events():
                await send(event)

        try:
            await self._generate(on_event)
            if not opened:
                await open_stream()
            # response.completed even when cut off (status "incomplete" inside), as vLLM
            # sends it: the `openai` client's get_final_response() waits for it.
            final = self._response(self._final_status())
            await send({"type": "response.completed", "response": final})
        except Exception as exc:
            if not opened and self.params.structured_outputs is not None:
                raise  # nothing sent yet: the response is this error (SSEResponse.early_error)
            if not opened:
                await open_stream()
            error = error_for(exc)  # the status is out: events
            await send(
                {
                    "type": "error",
                    "code": str(error.status),
                    "message": error.message,
                    "param": error.param,
                }
            )
            await send({"type": "response.failed", "response": self._response("failed", error)})
