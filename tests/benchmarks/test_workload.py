"""The shared benchmark workload and its reporting helpers (no model runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.workload import (
    BenchResult,
    fresh_tokens,
    make_workload,
    match_fraction,
    mean_common_prefix,
    model_vocab,
    percentile,
    render_table,
    warmup_workload_for_model,
    workload_for_model,
)

SPECIALS = {0, 1, 2, 3}


def test_workload_is_the_same_every_time() -> None:
    first = make_workload(32000, SPECIALS)
    second = make_workload(32000, SPECIALS)
    assert first.prompts == second.prompts
    assert first.num_requests == 64
    assert first.output_len == 64
    assert first.num_output_tokens == 64 * 64


def test_workload_shapes_and_token_ids() -> None:
    workload = make_workload(32000, SPECIALS)
    lengths = [len(p) for p in workload.prompts]
    assert all(32 <= n <= 128 for n in lengths)
    assert len(set(lengths)) > 20  # spread over the range, not one length
    ids = {t for p in workload.prompts for t in p}
    assert ids.isdisjoint(SPECIALS)
    assert min(ids) >= 0 and max(ids) < 32000


def test_workload_uses_its_own_rng() -> None:
    import random

    random.seed(123)
    first = make_workload(1000, SPECIALS)
    random.seed(456)
    assert make_workload(1000, SPECIALS).prompts == first.prompts


def test_other_seed_gives_other_prompts() -> None:
    assert make_workload(32000, seed=1).prompts != make_workload(32000, seed=0).prompts


def test_each_wave_gets_prompts_of_its_own() -> None:
    base = make_workload(32000, SPECIALS)
    assert fresh_tokens(base, 32000, SPECIALS, 0) is base
    waves = {c: fresh_tokens(base, 32000, SPECIALS, c) for c in (1, 16, 64)}
    for c, wave in waves.items():
        assert [len(p) for p in wave.prompts] == [len(p) for p in base.prompts]
        assert wave.output_len == base.output_len
        assert {t for p in wave.prompts for t in p}.isdisjoint(SPECIALS)
        assert fresh_tokens(base, 32000, SPECIALS, c).prompts == wave.prompts  # deterministic
    firsts = [tuple(w.prompts[0][:8]) for w in (base, *waves.values())]
    assert len(set(firsts)) == len(firsts)  # no two share a prefix


def test_workload_rejects_impossible_settings() -> None:
    with pytest.raises(ValueError, match="prompt lengths"):
        make_workload(100, min_prompt_len=10, max_prompt_len=5)
    with pytest.raises(ValueError, match="no usable token ids"):
        make_workload(4, SPECIALS)


def _fake_model_dir(path: Path) -> Path:
    config = {"vocab_size": 100, "bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": None}
    (path / "config.json").write_text(json.dumps(config))
    added = [
        {"id": 0, "content": "<unk>", "special": True},
        {"id": 9, "content": "<tool>", "special": True},
        {"id": 50, "content": "hello", "special": False},
    ]
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    return path


def test_model_vocab_reads_specials_from_config_and_tokenizer(tmp_path: Path) -> None:
    vocab_size, specials = model_vocab(_fake_model_dir(tmp_path))
    assert vocab_size == 100
    assert specials == {0, 1, 2, 7, 9}


def test_workload_for_model_avoids_its_specials(tmp_path: Path) -> None:
    folder = _fake_model_dir(tmp_path)
    workload = workload_for_model(folder)
    assert workload.prompts == make_workload(100, {0, 1, 2, 7, 9}).prompts
    warmup = warmup_workload_for_model(folder)
    assert warmup.num_requests == 4
    assert all(p not in workload.prompts for p in warmup.prompts)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 25, 1.75),
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([10.0, 20.0, 30.0], 50, 20.0),
        ([15.0, 20.0, 35.0, 40.0, 50.0], 40, 29.0),
        ([7.0], 99, 7.0),
    ],
)
def test_percentile_interpolates_linearly(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _result(engine: str, model: str, seconds: list[float], ready: float = 1.0) -> BenchResult:
    return BenchResult(
        engine=engine,
        model=model,
        num_requests=64,
        num_output_tokens=4096,
        generate_seconds=seconds,
        ready_seconds=ready,
    )


def test_result_uses_the_median_repeat() -> None:
    result = _result("x", "a", [4.0, 1.0, 2.0])
    assert result.median_seconds == 2.0
    assert result.output_tok_per_s == pytest.approx(2048.0)
    again = BenchResult.from_json(json.loads(json.dumps(result.to_json())))
    assert again == result


def test_table_ratios_against_each_baseline() -> None:
    results = [
        _result("asyncengine", "a", [1.0]),  # 4096 tok/s
        _result("hf-static", "a", [2.0]),  # 2048 tok/s
        _result("hf-cb", "a", [4.0]),  # 1024 tok/s
        _result("asyncengine", "b", [1.0], ready=0.5),  # no baselines on model b
    ]
    table = render_table(results, ["hf-static", "hf-cb"])
    lines = table.splitlines()
    assert lines[0] == "| engine | model | output tok/s | vs hf-static | vs hf-cb | ready s |"
    assert lines[1] == "|---|---|---:|---:|---:|---:|"
    assert lines[2] == "| asyncengine | a | 4096.0 | 2.00x | 4.00x | 1.00 |"
    assert lines[3] == "| hf-static | a | 2048.0 | 1.00x | 2.00x | 1.00 |"
    assert lines[4] == "| hf-cb | a | 1024.0 | 0.50x | 1.00x | 1.00 |"
    assert lines[5] == "| asyncengine | b | 4096.0 |  |  | 0.50 |"
    # Every row has as many cells as the header.
    assert len({line.count("|") for line in lines}) == 1


def test_table_extra_columns() -> None:
    result = _result("hf-cb", "a", [1.0])
    result.extra["identical"] = "50%"
    table = render_table([result], [], extra_columns=[("same", "identical"), ("n", "missing")])
    header, rule, row = table.splitlines()
    assert header == "| engine | model | output tok/s | ready s | same | n |"
    assert rule == "|---|---|---:|---:|---:|---:|"
    assert row == "| hf-cb | a | 4096.0 | 1.00 | 50% |  |"


def test_output_agreement() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert match_fraction(reference, reference) == 1.0
    assert mean_common_prefix(reference, reference) == 4.0
    drifted = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert match_fraction(drifted, reference) == 0.5
    assert mean_common_prefix(drifted, reference) == 3.0  # (2 + 4) / 2
    with pytest.raises(ValueError):
        match_fraction(reference[:1], reference)
