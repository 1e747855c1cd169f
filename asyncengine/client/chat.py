"""Chat messages → a prompt, through the model's chat template (for `LLM.chat`,
`AsyncLLM.chat` and the OpenAI server's chat endpoint alike).

Messages are dicts in OpenAI's shape, `{"role": ..., "content": ...}` (plus an optional
`name`). They are checked here, so a bad message is a ValueError naming it, not a template
error from deep inside jinja.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncengine.client.tokenizer import Tokenizer

ChatMessage = Mapping[str, Any]
Conversation = Sequence[ChatMessage]

ROLES = ("system", "developer", "user", "assistant", "tool")
# Names the template receives from us: a caller's chat_template_kwargs may not replace them.
_RESERVED_KWARGS = (
    "messages",
    "add_generation_prompt",
    "tokenize",
    "bos_token",
    "eos_token",
    "pad_token",
)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation: the template's text and its token ids (the template writes
    the special tokens, so the ids carry no second BOS)."""

    text: str
    token_ids: list[int]


def check_conversation(messages: object) -> list[dict[str, Any]]:
    """The messages as plain dicts; ValueError naming the first bad one and what is allowed."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"not {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is invalid: must be one of {ROLES}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string, not {type(content).__name__}"
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"messages[{i}].name must be a string, not {type(name).__name__}")
        checked.append(dict(message))
    return checked


def render_chat(
    tokenizer: Tokenizer,
    messages: object,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """Check `messages` and render them with the model's chat template.

    ValueError for a bad message, a model without a chat template, or a template that fails
    (templates raise on what they do not support, e.g. a system message in some models).
    """
    checked = check_conversation(messages)
    if tokenizer.chat_template is None:
        raise ValueError(
            "this model has no chat template (none in tokenizer_config.json or "
            "chat_template.jinja): format the prompt yourself and call generate()"
        )
    extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            checked, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from None
    assert isinstance(text, str)
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False))
