"""Special tokens are never part of a constrained output: xgrammar takes them for their text
(`<pad>` would be five characters of a JSON string), but the detokenizer drops them, so an
output holding one would not be the text the grammar checked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from asyncengine.sched.structured_outputs import StructuredOutputManager


@pytest.mark.timeout(120)
def test_special_tokens_other_than_eos_are_special_to_the_grammar(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from transformers import AutoTokenizer

    model = tiny_model_factory("llama", tokenizer="ascii")
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(str(model), 256, (eos,))
    import xgrammar

    # A grammar whose characters spell every special token's text.
    compiled = manager._make_compiler().compile_grammar("root ::= [<>/a-z]+")
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()  # bit t % 32 of word t // 32: token t allowed

    def allowed(token_id: int) -> bool:
        return bool((words[token_id // 32] >> (token_id % 32)) & 1)

    assert allowed(tokenizer.convert_tokens_to_ids("a"))
    for token_id in set(tokenizer.all_special_ids) - {eos}:
        assert not allowed(token_id), tokenizer.convert_ids_to_tokens(token_id)
