"""OpenAI's request and response bodies, as msgspec Structs.

Requests are decoded straight from the body bytes with typed decoders: a wrong type is a
`msgspec.ValidationError` that names the field (mapped to a 400 by `errors.py`); ranges are
checked by `SamplingParams`. Unknown fields are ignored, as vLLM does, so clients that send
newer parameters still work. Responses are Structs too: they encode without building dicts.

Besides OpenAI's parameters, the requests accept vLLM's sampling extensions (`top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `priority`), which the official client
passes through `extra_body`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from asyncengine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# ---- requests --------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM's extension: a running `usage` in every chunk.
    continuous_usage_stats: bool = False


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """The parameters both endpoints share. None means "the default" (clients send nulls)."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    response_format: dict[str, Any] | None = None
    # vLLM's extension: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids; the
    # union is that loose because msgspec allows one array type per union (checked by hand).
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions for the chat template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def sampling_params(
    request: _SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: Iterable[tuple[str, float | int]] = (),
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams (DELTA outputs); ValueError naming a bad field.

    `defaults` (the model's, from its generation_config.json) fill the fields the request
    leaves out, as vLLM does; `max_tokens` is the endpoint's own (None: up to the context),
    or the model's `max_new_tokens` where the request gave none."""
    model = dict(defaults)
    model_max_tokens = model.pop("max_tokens", None)
    if max_tokens is None and isinstance(model_max_tokens, int):
        max_tokens = model_max_tokens
    given: dict[str, Any] = model | {
        name: getattr(request, name)
        for name in (
            "n", "temperature", "top_p", "stop", "seed", "presence_penalty",
            "frequency_penalty", "top_k", "min_p", "min_tokens", "repetition_penalty",
            "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
        )
        if getattr(request, name) is not None
    }  # fmt: skip
    return SamplingParams(
        **given,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_outputs,
    )


# ---- responses -------------------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    # None for an echoed prompt's first token: nothing comes before it.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A completion, and each chunk of a streamed one (OpenAI uses one shape for both)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None  # null when the message is tool calls alone
    tool_calls: list[ToolCall] | None = None
    # With a reasoning parser: the model's thinking, under both of the names clients read
    # (DeepSeek's and vLLM's older `reasoning_content`, vLLM's newer `reasoning`).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call: the first names it, the rest add to its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # the thinking, as AssistantMessage's
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "asyncengine"
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model; None for the base itself


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
