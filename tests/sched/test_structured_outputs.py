"""Structured outputs end to end on a tiny random-weight model: whatever a random model at
temperature 1.0 samples, a finished output obeys its constraint — alone, 16 at a time, and
through preemption (a KV pool too small for the batch)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm(ascii_llama: Path) -> LLM:
    return LLM(ascii_llama, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def small_pool_llm(ascii_llama: Path) -> LLM:
    # 10 blocks of 16 tokens for 16 requests of up to ~125 tokens: preemption is certain.
    return LLM(
        ascii_llama,
        device="cpu",
        dtype="float32",
        max_model_len=160,
        num_kv_blocks=10,
        block_size=16,
        max_num_seqs=16,
        enable_prefix_caching=False,
    )


# ---- a small family of JSON schemas -------------------------------------------------------

_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
            st.integers(0, 2),
            st.integers(0, 4),
        ),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 1000),
        ),
        st.builds(
            lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 100},
            st.integers(-10, 10),
        ),
        st.just({"type": "boolean"}),
        st.lists(
            st.one_of(_NAMES, st.integers(-5, 5), st.booleans(), st.none()),
            min_size=1,
            max_size=4,
            unique=True,
        ).map(lambda values: {"enum": values}),
    )


def _field(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    leaf = _leaf()
    if depth == 0:
        return leaf
    return st.one_of(
        leaf,
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            leaf,
            st.integers(0, 3),
        ),
        _object(depth - 1),
    )


def _object(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        names = list(props)
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(names, required, strict=False) if r],
            "additionalProperties": False,
        }

    return st.builds(
        build,
        st.dictionaries(_NAMES, st.deferred(lambda: _field(depth)), min_size=1, max_size=4),
        st.lists(st.booleans(), min_size=4, max_size=4),
    )


SCHEMAS = _object(depth=1)


def _params(constraint: StructuredOutputsParams, seed: int, **kw: Any) -> SamplingParams:
    settings: dict[str, Any] = {"temperature": 1.0, "max_tokens": MAX_TOKENS, **kw}
    return SamplingParams(seed=seed, structured_outputs=constraint, **settings)


# Two full blocks: 5 such requests fill the small pool, and each needs a third block for its
# first output token, so the pool must preempt.
LONG_PROMPT = list(range(10, 42))


def _check_json(
    llm: LLM, schema: dict[str, Any], num_requests: int, prompt: str | list[int] = "hi"
) -> None:
    constraint = StructuredOutputsParams(json=schema)
    params = [_params(constraint, seed) for seed in range(num_requests)]
    outs = llm.generate([prompt] * num_requests, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    for out in finished:
        jsonschema.validate(json.loads(out.text), schema)
    # Not vacuous: a constrained random model ends most bounded objects in time.
    assert finished, [o.outputs[0].text for o in outs]


_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(schema=SCHEMAS)
def test_json_schema_alone(llm: LLM, schema: dict[str, Any]) -> None:
    _check_json(llm, schema, 1)


@settings(_SETTINGS, max_examples=12)
@given(schema=SCHEMAS)
def test_json_schema_16_concurrent(llm: LLM, schema: dict[str, Any]) -> None:
    _check_json(llm, schema, 16)


@settings(_SETTINGS, max_examples=8)
@given(schema=SCHEMAS)
def test_json_schema_16_concurrent_through_preemption(
    small_pool_llm: LLM, schema: dict[str, Any]
) -> None:
    before = small_pool_llm.statistics().num_preemptions
    _check_json(small_pool_llm, schema, 16, LONG_PROMPT)
    assert small_pool_llm.statistics().num_preemptions > before


def test_json_schema_alone_through_preemption(small_pool_llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"k": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["k"],
    }
    _check_json(small_pool_llm, schema, 1, LONG_PROMPT)


# ---- regex, choice, grammar -----------------------------------------------------------------

GRAMMAR = r"""
root ::= "(" expr ")"
expr ::= term (("+" | "*") term){0,3}
term ::= [0-9]{1,3} | "x"
"""
GRAMMAR_LANGUAGE = re.compile(r"\((?:[0-9]{1,3}|x)(?:[+*](?:[0-9]{1,3}|x)){0,3}\)")

CONSTRAINTS = {
    "regex": (
        StructuredOutputsParams(regex=r"[a-f]{2,5}-\d{1,3}(\.[a-z]{1,4})?"),
        lambda text: re.fullmatch(r"[a-f]{2,5}-\d{1,3}(\.[a-z]{1,4})?", text),
    ),
    "choice": (
        StructuredOutputsParams(choice=["yes", "no", 'say "maybe"', "hello world"]),
        lambda text: text in {"yes", "no", 'say "maybe"', "hello world"},
    ),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR), GRAMMAR_LANGUAGE.fullmatch),
    "json_object": (
        StructuredOutputsParams(json_object=True),
        lambda text: isinstance(json.loads(text), dict),
    ),
}

# Every sampling method meets the mask: greedy, temperature with top-k/top-p/min-p, penalties.
SAMPLING = {
    "random": {},
    "greedy": {"temperature": 0.0},
    "filters": {"top_k": 5, "top_p": 0.9, "min_p": 0.05},
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("pool", ["large", "small"])
def test_constraints_hold_for_16_concurrent(
    request: pytest.FixtureRequest, pool: str, kind: str, sampling: str
) -> None:
    if pool == "small" and sampling != "random":
        pytest.skip("one sampling method is enough through preemption")
    llm: LLM = request.getfixturevalue("llm" if pool == "large" else "small_pool_llm")
    constraint, matches = CONSTRAINTS[kind]
    params = [_params(constraint, seed, **SAMPLING[sampling]) for seed in range(16)]
    prompts = ["hello", LONG_PROMPT] if pool == "small" else ["hello", "the engine"]
    outs = llm.generate(prompts * 8, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    # A greedy random model may loop inside an open-ended constraint (json_object) until
    # max_tokens; sampled ones end.
    assert finished or sampling == "greedy"
    for out in finished:
        assert matches(out.text), out.text


def test_n_sequences_each_obey_the_constraint(llm: LLM) -> None:
    constraint, matches = CONSTRAINTS["regex"]
    [out] = llm.generate(["hello"], _params(constraint, seed=5, n=4), use_tqdm=False)
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert completion.finish_reason == "stop" and matches(completion.text)


def test_max_tokens_and_stop_strings_cut_a_constrained_output(llm: LLM) -> None:
    long = StructuredOutputsParams(regex=r"[a-z]{30}")
    [out] = llm.generate(["hello"], _params(long, seed=1, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert re.fullmatch(r"[a-z]+", out.outputs[0].text)
    stopped = StructuredOutputsParams(regex=r"ab(c|d)efgh")
    [out] = llm.generate(["hello"], _params(stopped, seed=1, stop=["e"]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "e"
    assert out.outputs[0].text in ("abc", "abd")


def test_unconstrained_greedy_requests_are_unchanged_by_constrained_batch_mates(
    llm: LLM,
) -> None:
    prompts = ["hello world", "the engine is fast", "a block"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    solo = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    constraint = StructuredOutputsParams(json={"type": "object"})
    mixed_params = [greedy, _params(constraint, 1), greedy, _params(constraint, 2), greedy]
    mixed_prompts = [prompts[0], "hello", prompts[1], "hello", prompts[2]]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == solo


def test_equal_constraints_compile_once(llm: LLM) -> None:
    manager = llm.engine.engine_core.scheduler.structured_outputs
    assert manager is not None
    schema = {"type": "object", "properties": {"zz": {"type": "boolean"}}, "required": ["zz"]}
    llm.generate(["a"], _params(StructuredOutputsParams(json=schema), 0), use_tqdm=False)
    compiles = manager.num_compiles
    # The same schema as text, with its keys spaced differently: the same cache entry.
    again = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    llm.generate(["b"] * 4, _params(again, 0), use_tqdm=False)
    assert manager.num_compiles == compiles


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (StructuredOutputsParams(json={"type": "no-such-type"}), "no-such-type"),
        # A schema feature the grammar cannot enforce is refused, named (not ignored).
        (
            StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
            "uniqueItems is not supported",
        ),
        (StructuredOutputsParams(regex="(unclosed"), "parenthesis"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_an_invalid_constraint_fails_its_request_alone(
    llm: LLM, constraint: StructuredOutputsParams, named: str
) -> None:
    with pytest.raises(ValueError, match="could not be compiled") as info:
        llm.generate(["hello"], _params(constraint, 0), use_tqdm=False)
    assert named in str(info.value)
    # The engine goes on, constrained or not.
    [out] = llm.generate(["hello"], _params(CONSTRAINTS["regex"][0], 0), use_tqdm=False)
    assert out.outputs[0].text


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{not json"}, "StructuredOutputsParams.json="),
        ({"json": "[1, 2]"}, "must be a JSON schema"),
        ({"choice": []}, "StructuredOutputsParams.choice="),
        ({"grammar": "  "}, "StructuredOutputsParams.grammar="),
    ],
)
def test_malformed_constraints_are_refused_at_construction(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        StructuredOutputsParams(**kwargs)
