"""Reasoning parsers (`serve --reasoning-parser`): a model's thinking, split from its answer.

Reasoning models write their thinking between `<think>` and `</think>`, then the answer. The
chat endpoint sends the thinking as `reasoning_content` (and `reasoning`, vLLM's newer name)
and the rest as `content`; tool calls are parsed from the content only. The names and the
semantics are vLLM's:

- `deepseek_r1`: the output starts in the thinking (DeepSeek-R1's template often writes the
  opening `<think>` into the prompt); a leading `<think>` is dropped; everything before the
  first `</think>` is reasoning. No `</think>` at all (cut off by `max_tokens`): all reasoning.
- `qwen3`: the output is thinking only when it opens with `<think>` (after white space);
  otherwise it is all content (Qwen3 with thinking off, or an instruct model).

Both look at the end of the rendered prompt first: a prompt that ends inside an open
`<think>` (Qwen3-Thinking-2507's template) starts the output in the thinking; one that ends
with a closed block (Qwen3's `enable_thinking: false` writes `<think>\\n\\n</think>\\n\\n`) makes
the whole output content.

`ReasoningStream` does the split on DELTA text: a tag split across deltas ("<th", "ink>") is
held back until it resolves, so the tags never reach the client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

START = "<think>"
END = "</think>"


class Phase(enum.Enum):
    OPENING = "opening"  # at the start: the output may open with <think>
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One `--reasoning-parser`: how a model's output splits into thinking and answer."""

    name: str
    # What an output that does not open with <think> is: thinking (deepseek_r1) or answer.
    unopened: Phase

    def first_phase(self, prompt_text: str | None) -> Phase:
        """Where the output starts, given the rendered prompt that precedes it."""
        tail = (prompt_text or "").rstrip()
        if tail.endswith(START):
            return Phase.REASONING
        if tail.endswith(END):  # the template closed the thinking (thinking turned off)
            return Phase.CONTENT
        return Phase.OPENING

    def stream(self, prompt_text: str | None) -> ReasoningStream:
        """A splitter for one output's DELTA texts."""
        return ReasoningStream(self.first_phase(prompt_text), self.unopened)

    def extract(self, text: str, prompt_text: str | None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        stream = self.stream(prompt_text)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", unopened=Phase.REASONING),
    "qwen3": ReasoningParser("qwen3", unopened=Phase.CONTENT),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named `name` (None: none); ValueError naming the known ones."""
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}: known ones are {known}") from None


class ReasoningStream:
    """Splits one output's text, fed in pieces, into reasoning and content pieces."""

    def __init__(self, phase: Phase, unopened: Phase) -> None:
        self.phase = phase
        self.unopened = unopened
        self.held = ""  # text not sent yet: it may be the start of a tag

    @property
    def in_reasoning(self) -> bool:
        return self.phase is Phase.REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) to send for `delta`: either may be empty."""
        text = self.held + delta
        self.held = ""
        reasoning, content = "", ""
        while text:
            if self.phase is Phase.OPENING:
                opening = text.lstrip()
                if opening.startswith(START):
                    text, self.phase = opening[len(START) :], Phase.REASONING
                elif START.startswith(opening):  # white space, or "<th": not decided yet
                    self.held, text = text, ""
                else:
                    self.phase = self.unopened
            elif self.phase is Phase.REASONING:
                end = text.find(END)
                if end >= 0:
                    reasoning += text[:end]
                    text, self.phase = text[end + len(END) :], Phase.CONTENT
                else:
                    keep = _partial_tag(text, END)
                    reasoning += text[: len(text) - keep]
                    self.held, text = text[len(text) - keep :], ""
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end of the output: a tag that never
        completed is text after all. An open thinking block stays reasoning."""
        held, self.held = self.held, ""
        phase = self.unopened if self.phase is Phase.OPENING else self.phase
        return (held, "") if phase is Phase.REASONING else ("", held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
