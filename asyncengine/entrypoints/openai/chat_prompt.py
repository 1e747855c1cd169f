"""What the chat-shaped endpoints (`/v1/chat/completions`, `/v1/responses`) share before the
engine sees a request: the messages rendered through the model's chat template (with the tool
prompt where tools are given), and the refusal of an output constraint that a reasoning model
would have to think inside."""

from __future__ import annotations

import re
from typing import Any

from asyncengine.client.chat import render_chat
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.entrypoints.openai.errors import bad_request
from asyncengine.entrypoints.openai.generation import EnginePrompt
from asyncengine.entrypoints.openai.reasoning import Phase, ReasoningParser
from asyncengine.entrypoints.openai.tool_calls import ToolRequest, render_tool_messages
from asyncengine.sampling_params import SamplingParams

# render_chat names a bad message at the start of its message: "messages[2].content must...".
_MESSAGE_FIELD = re.compile(r"^(messages\[\d+\](?:\.\w+)?)")


def render_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    chat_template_kwargs: dict[str, Any] | None,
    param: str,
    add_generation_prompt: bool = True,
) -> EnginePrompt:
    """The messages through the chat template; 400 for what the template refuses, naming the
    request's field `param` ("messages": the message render_chat names, "messages[2].role";
    "input": the whole input): a bad message, or what a template raises on the data it was
    given (TypeError, RuntimeError: the request's, as in vLLM)."""
    template_kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        messages, extra = render_tool_messages(messages, tools, tokenizer.chat_template)
        template_kwargs.update(extra)
    try:
        prompt = render_chat(
            tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=template_kwargs,
        )
    except ValueError as exc:
        m = _MESSAGE_FIELD.match(str(exc)) if param == "messages" else None
        raise bad_request(str(exc), m.group(1) if m else param) from None
    except (TypeError, RuntimeError) as exc:
        raise bad_request(f"the chat template failed: {type(exc).__name__}: {exc}", param) from None
    return EnginePrompt(prompt.token_ids, prompt.text)


def check_reasoning(
    parser: ReasoningParser | None,
    tools: ToolRequest | None,
    params: SamplingParams,
    prompt: EnginePrompt,
    format_field: str | None,
) -> None:
    """400 for a constrained output that the model would have to think inside: the grammar
    applies from the first token, and the thinking comes first. Allowed when the prompt has
    closed the thinking already (`chat_template_kwargs: {"enable_thinking": false}` with
    Qwen3's template): then the whole output is the answer. `format_field` names the request's
    output-format field when it set the constraint (chat's response_format, Responses'
    text.format)."""
    if parser is None or params.structured_outputs is None:
        return
    if parser.first_phase(prompt.text) is Phase.CONTENT:
        return
    if tools is not None and tools.constraint() is not None:
        field_name = "tool_choice"
    elif format_field is not None:
        field_name = format_field
    else:
        field_name = "structured_outputs"
    raise bad_request(
        f"{field_name} constrains the output from its first token, and with the server's "
        f"reasoning parser ({parser.name}) the output starts with the model's thinking: "
        "give no constraint, or turn thinking off in the template "
        '(chat_template_kwargs: {"enable_thinking": false})',
        field_name,
    )
