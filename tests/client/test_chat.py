"""chat() on both APIs: conversations rendered with the model's chat template, the same
tokens as generate() on the rendered prompt, and a clear ValueError for a bad message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from async_helpers import ENGINE_KW

from asyncengine import LLM, AsyncLLM, SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
WORLD = [{"role": "user", "content": "the world"}]
RENDERED = "<s>system : be brief user : hello assistant :"


@pytest.fixture(scope="module")
def llm(chat_model: Path) -> Iterator[LLM]:
    llm = LLM(chat_model, **ENGINE_KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
async def engine(chat_model: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_pretrained(chat_model, core="thread", **ENGINE_KW) as engine:
        yield engine


def test_llm_chat_is_generate_on_the_rendered_conversation(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = str(tokenizer.apply_chat_template(HELLO, add_generation_prompt=True))
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes the BOS
    (chat,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
    (plain,) = llm.generate([ids], GREEDY, use_tqdm=False)
    assert chat.prompt == text and chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(chat.outputs[0].token_ids) == 8


def test_llm_chat_takes_a_list_of_conversations_in_order(llm: LLM) -> None:
    outs = llm.chat([HELLO, WORLD, HELLO], GREEDY, use_tqdm=False)
    assert [o.prompt.count("user") for o in outs if o.prompt] == [1, 1, 1]
    assert "the world" in (outs[1].prompt or "")
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


async def test_async_chat_streams_the_same_tokens(engine: AsyncLLM, llm: LLM) -> None:
    (expected,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
    outs = [out async for out in engine.chat(HELLO, GREEDY, request_id="chat-1")]
    assert outs[-1].finished and outs[-1].request_id == "chat-1"
    assert outs[-1].prompt == expected.prompt
    assert outs[-1].outputs[0].token_ids == expected.outputs[0].token_ids


BAD: list[tuple[Any, str]] = [
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role='wizard' is invalid"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string, not int"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string, not NoneType"),
    ([], "messages is empty"),
    ("hello", "messages must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
]


@pytest.mark.parametrize(("messages", "match"), BAD)
async def test_bad_messages_raise_value_error_and_the_engine_goes_on(
    engine: AsyncLLM, llm: LLM, messages: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        async for _ in engine.chat(messages, GREEDY):
            pass
    outs = [out async for out in engine.chat(WORLD, GREEDY)]
    assert outs[-1].finished


def test_a_model_without_a_chat_template_is_refused(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, **ENGINE_KW)
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            llm.chat(HELLO, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_template_kwargs_cannot_replace_the_special_tokens(llm: LLM) -> None:
    (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs={"bos_token": "X"})
    assert out.prompt == RENDERED
