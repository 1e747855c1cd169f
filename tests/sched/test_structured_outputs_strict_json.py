"""JSON-schema outputs are JSON, end to end, on a tiny random model whose vocabulary holds
every byte (control characters and the pieces of UTF-8 included): whatever it samples at
temperature 1.0, a finished output parses with a strict `json.loads` and validates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from structured_outputs_schemas import SHORT_FORMATS, check_output, schemas
from transformers import AutoTokenizer

from asyncengine import LLM, SamplingParams, StructuredOutputsParams
from asyncengine.sched.structured_outputs import StructuredOutputManager

pytestmark = pytest.mark.timeout(180)

# The schema: a bounded string, which xgrammar 0.2.8 let hold raw control characters.
BOUNDED_STRING = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 8}},
    "required": ["s"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bytes_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", tokenizer="bytes")


@pytest.fixture(scope="module")
def llm(bytes_llama: Path) -> LLM:
    return LLM(bytes_llama, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16)


def _generate(llm: LLM, schema: dict[str, Any], seeds: range, max_tokens: int) -> list[Any]:
    constraint = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint
        )
        for seed in seeds
    ]
    outs = llm.generate(["hi"] * len(seeds), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_the_grammar_refuses_a_raw_control_character_in_a_bounded_string(
    bytes_llama: Path,
) -> None:
    manager = StructuredOutputManager(str(bytes_llama), vocab_size=512, eos_token_ids=(2,))
    try:
        grammar = manager.grammar_for(StructuredOutputsParams(json=BOUNDED_STRING))
        grammar.future.result(timeout=60)
        grammar.start()
        tokenizer = AutoTokenizer.from_pretrained(bytes_llama)

        def token(text: str) -> int:
            [token_id] = tokenizer.encode(text, add_special_tokens=False)
            return int(token_id)

        for piece in ["{", '"', "s", '"', ":", " ", '"']:
            assert grammar.accept(token(piece)), piece
        assert not grammar.accept(token("\x01"))
        assert not grammar.accept(token("\t"))
        # Escaped, they are welcome.
        assert grammar.accept(token("\\")) and grammar.accept(token("t"))
    finally:
        manager.shutdown()


def test_bounded_strings_are_json_end_to_end(llm: LLM) -> None:
    # At most 8 characters of at most 12 tokens each (an escaped surrogate pair), and the
    # object around them: every request finishes within its budget.
    outs = _generate(llm, BOUNDED_STRING, range(16), max_tokens=160)
    assert [o.finish_reason for o in outs] == ["stop"] * 16
    for out in outs:
        check_output(out.text, BOUNDED_STRING)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=schemas(SHORT_FORMATS))
def test_random_schemas_give_strict_valid_json(llm: LLM, schema: dict[str, Any]) -> None:
    outs = _generate(llm, schema, range(4), max_tokens=320)
    # One cut by max_tokens is only a prefix; the others must be whole and valid.
    finished = [o for o in outs if o.finish_reason == "stop"]
    for out in finished:
        check_output(out.text, schema)
    assert len(finished) >= 3, (json.dumps(schema), [o.text for o in outs])
