"""Structured outputs through AsyncLLM.generate and AsyncLLM.chat, with the engine core in
its own process (the constraint crosses the socket), on asyncio and trio."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest

from asyncengine import AsyncLLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
async def engine(
    ascii_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[AsyncLLM]:
    path = tmp_path_factory.mktemp("ascii-chat-async") / "model"
    shutil.copytree(ascii_llama, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    async with AsyncLLM.from_pretrained(
        path, device="cpu", dtype="float32", max_model_len=256
    ) as engine:
        yield engine


async def test_generate_and_chat_obey_a_schema(engine: AsyncLLM) -> None:
    params = SamplingParams(
        temperature=1.0,
        seed=4,
        max_tokens=100,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    out = None
    async for out in engine.generate("hello", params):  # noqa: B007
        pass
    assert out is not None
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    async for out in engine.chat([{"role": "user", "content": "hi"}], params):  # noqa: B007
        pass
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


async def test_an_invalid_grammar_is_a_value_error_and_the_engine_goes_on(
    engine: AsyncLLM,
) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= ("))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar could not be compiled"):
        async for _ in engine.generate("hello", bad):
            pass
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    async for out in engine.generate("hello", choice):  # noqa: B007
        pass
    assert out.outputs[0].text in ("x", "y")
