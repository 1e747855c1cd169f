"""`echo` with `logprobs` on /v1/completions: the prompt's tokens come back with their
logprobs (the first one null, as OpenAI's), then the completion's, in one list."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai_testing import MODEL_NAME

pytestmark = pytest.mark.timeout(120)

PROMPT = "the engine is fast and the cache is warm"
GREEDY: dict[str, Any] = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True})


def test_echo_with_logprobs_returns_the_prompts_logprobs_first(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=2, **GREEDY)
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, logprobs=2, echo=True, **GREEDY
    )
    lp, plain_lp = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and plain_lp is not None
    assert lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    num_prompt = len(lp.tokens) - len(plain_lp.tokens)
    assert num_prompt == echoed.usage.prompt_tokens  # type: ignore[union-attr]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    pairs = zip(lp.token_logprobs[1:num_prompt], lp.top_logprobs[1:num_prompt], strict=True)
    for logprob, top in pairs:
        assert logprob is not None and logprob <= 0.0
        assert top is not None and 1 <= len(top) <= 3
    # The completion's part is what it is without echo, its offsets after the prompt's text.
    assert lp.tokens[num_prompt:] == plain_lp.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain_lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[num_prompt] == len(PROMPT)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_streamed_echo_with_logprobs_sends_the_prompts_with_the_first_chunk(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, logprobs=1, echo=True, stream=True, **GREEDY
        )
    )
    texts = [c.choices[0] for c in chunks if c.choices]
    first = texts[0].logprobs
    assert first is not None and first.token_logprobs[0] is None
    assert texts[0].text.startswith(PROMPT)
    assert len(first.tokens) > 1  # the prompt's tokens and the first completion token
    rest = [c.logprobs for c in texts[1:] if c.logprobs is not None]
    assert all(r.token_logprobs[0] is not None for r in rest)
