"""Tool calling for the chat endpoint: `tools`, `tool_choice`, `parallel_tool_calls`.

request → `ToolRequest` (checked: a 400 naming the bad part) → messages rendered with the tools
(through the chat template when it takes `tools`, else `DEFAULT_TOOL_PROMPT` as a system
message) → for `"required"` or a named function, a JSON-schema constraint, so the arguments
always parse against the function's schema → the output parsed into OpenAI tool calls
(`parse_tool_calls`), or streamed as tool-call deltas (`ToolCallStream`).

What the model writes:
- `"auto"`: free text; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
  common format of Qwen, Hermes and others) or a bare JSON call are read as calls.
- `"required"`: constrained to a JSON array of `{"name", "arguments"}` objects (one object
  when `parallel_tool_calls` is false), each valid against its function's schema.
- a named function: constrained to that function's arguments object.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncengine.entrypoints.openai.errors import bad_request
from asyncengine.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from asyncengine.sampling_params import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"

DEFAULT_TOOL_PROMPT = """\
You can call these tools (JSON schemas of their arguments):
{tools}
To call a tool, answer with one block per call:
<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>"""

_REQUIRED_HINT = (
    'Answer only with a JSON array of calls: [{"name": "<tool name>", "arguments": {...}}].'
)
_NAMED_HINT = "Call the tool {name}: answer only with its arguments as a JSON object."


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tools, checked. `choice`: "auto", "required", or a function's name."""

    functions: dict[str, dict[str, Any]]  # name → {"name", "description", "parameters"}
    choice: str
    parallel: bool = True

    @property
    def named(self) -> str | None:
        return self.choice if self.choice not in TOOL_CHOICES else None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar for "required" and a named function; None for "auto"."""
        if self.choice == "auto":
            return None
        if self.named is not None:
            return StructuredOutputsParams(json=_parameters(self.functions[self.named]))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, fn in self.functions.items()
        ]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if not self.parallel:
            return StructuredOutputsParams(json=call)
        return StructuredOutputsParams(json={"type": "array", "items": call, "minItems": 1})

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": fn} for fn in self.functions.values()]

    def system_prompt(self) -> str:
        """`DEFAULT_TOOL_PROMPT` for templates that do not render tools, with the choice's hint."""
        listing = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in self.functions.values())
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
        if self.named is not None:
            return f"{prompt}\n{_NAMED_HINT.format(name=self.named)}"
        if self.choice == "required":
            return f"{prompt}\n{_REQUIRED_HINT}"
        return prompt


def tool_request(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None
) -> ToolRequest | None:
    """The checked tools of a request; None when no tool may be called. 400 naming the part."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise bad_request(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )
        functions[name] = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        # A str first: an unhashable name (a list, say) must not reach `in functions`.
        known = isinstance(named, str) and named in functions
        if tool_choice.get("type") != "function" or not known:
            raise bad_request(
                f"tool_choice names no function of tools: {tool_choice!r}; allowed are "
                f'{", ".join(TOOL_CHOICES)} or {{"type": "function", "function": {{"name": '
                f"one of {sorted(functions)}}}}}",
                "tool_choice",
            )
        choice = str(named)
    elif tool_choice in ("auto", "required"):
        choice = tool_choice
    else:
        raise bad_request(
            f"tool_choice={tool_choice!r} is invalid: must be one of {', '.join(TOOL_CHOICES)} "
            'or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return ToolRequest(functions, choice, parallel if parallel is not None else True)


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def render_tool_messages(
    messages: list[dict[str, Any]], tools: ToolRequest, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template arguments that show `tools` to the model.

    A template that mentions `tools` receives them (and earlier calls as `tool_calls`);
    otherwise the tools go into the system message and earlier calls become
    `<tool_call>` text, the format the model is asked to write.
    """
    if template is not None and "tools" in template:
        return messages, {"tools": tools.template_tools()}
    rendered: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            blocks = [
                f"{_OPEN}{json.dumps(_as_call(c), ensure_ascii=False)}{_CLOSE}" for c in calls
            ]
            message["content"] = "\n".join([message.get("content") or "", *blocks]).strip()
        rendered.append(message)
    prompt = tools.system_prompt()
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _as_call(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        arguments = _load(arguments) if _load(arguments) is not None else arguments
    return {"name": fn.get("name"), "arguments": arguments}


# ---- reading calls out of the output ---------------------------------------------------------


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str, tools: ToolRequest) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output; no calls when the text holds none that name a
    known function with object arguments (then all of it is content)."""
    if tools.named is not None:
        arguments = _load(text.strip())
        if isinstance(arguments, dict):
            return None, [ParsedCall(tools.named, json.dumps(arguments, ensure_ascii=False))]
        return text, []
    calls: list[ParsedCall] = []
    content_parts: list[str] = []
    if _OPEN in text:
        rest = text
        while (start := rest.find(_OPEN)) >= 0:
            content_parts.append(rest[:start])
            body = rest[start + len(_OPEN) :].lstrip()
            try:
                value, end = json.JSONDecoder().raw_decode(body)
            except ValueError:
                return text, []
            calls.extend(_calls_from(value, tools))
            rest = body[end:].lstrip()
            if rest.startswith(_CLOSE):
                rest = rest[len(_CLOSE) :]
        content_parts.append(rest)
    else:
        calls = _calls_from(_load(text.strip()), tools)
        if not calls:
            return text, []
    content = "".join(content_parts).strip() or None
    return (content, calls) if calls else (text, [])


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_from(value: Any, tools: ToolRequest) -> list[ParsedCall]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in tools.functions:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append(ParsedCall(str(item["name"]), json.dumps(arguments, ensure_ascii=False)))
    return calls


# ---- streaming --------------------------------------------------------------------------------


class ToolCallStream:
    """Turns one choice's text deltas into content deltas and OpenAI tool-call deltas.

    A named function's arguments stream as they come (the constraint makes the whole output
    the arguments). Otherwise text that may be a call (JSON from the start, or from a
    `<tool_call>` on) is held back and parsed when the choice finishes.
    """

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.named_call: ParsedCall | None = None
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) to send for `delta`."""
        self.text += delta
        if self.tools.named is not None:
            if self.named_call is None:
                self.named_call = ParsedCall(self.tools.named, "")
                head = DeltaToolCall(
                    index=0,
                    id=self.named_call.id,
                    type="function",
                    function=DeltaFunctionCall(name=self.tools.named, arguments=delta),
                )
                return "", [head]
            return "", [
                DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))
            ] if delta else []
        if self.tools.choice == "required":
            return "", []
        safe = self._safe_content_end()
        content = self.text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return content, []

    def _safe_content_end(self) -> int:
        """How much of the text is surely content: all of it before a possible call."""
        stripped = self.text.lstrip()
        if not stripped or stripped[0] in "{[":
            return self.sent  # may be a bare JSON call: hold it all
        start = self.text.find(_OPEN)
        if start >= 0:
            return start
        # Hold a tail that may be the start of "<tool_call>".
        for keep in range(min(len(_OPEN) - 1, len(self.text)), 0, -1):
            if _OPEN.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) at the end of the choice; `calls` is then set."""
        if self.tools.named is not None:
            _, calls = parse_tool_calls(self.text, self.tools)
            if calls and self.named_call is not None:
                self.calls = [self.named_call]
            return "", []
        _, calls = parse_tool_calls(self.text, self.tools)
        self.calls = calls
        if not calls:  # it was content after all: send what was held back
            rest = self.text[self.sent :]
            self.sent = len(self.text)
            return rest, []
        # The content before the first call is out; text after the calls is not streamed.
        deltas = [
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(calls)
        ]
        return "", deltas
