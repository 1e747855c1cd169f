"""The peers harness's report code: merging runs, vLLM's better setting, ratios, tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.harness import round_order, round_plan
from benchmarks.peers.report import (
    BATCHED_HEADER,
    FIGURE_HEADER,
    RATIO_HEADER,
    SERVE_HEADER,
    TARGETS,
    PeerResult,
    batched_rows,
    best_vllm,
    figure_rows,
    markdown_table,
    merge_rounds,
    merge_runs,
    ratio_rows,
    serve_rows,
)
from benchmarks.peers.runner import _stream_stats


def _stream(tok_s: float, ttft: float, itl: float) -> dict[str, object]:
    return {
        "tok_s": tok_s,
        "ttft_ms": {"p50": ttft, "p99": ttft * 2},
        "itl_ms": {"p50": itl, "p99": itl * 3},
    }


def _results() -> list:
    ours = merge_runs(
        "asyncengine",
        "a",
        [
            {"ready_s": 2.0, "offline_seconds": [1.0, 2.0, 4.0], "num_output_tokens": 4000,
             "rss_tree_mb": 900.0},
            {"ready_s": 2.5, "1": _stream(300, 8, 3.0), "64": _stream(5000, 100, 12),
             "rss_tree_mb": 950.0},
        ],
    )  # fmt: skip
    v1 = merge_runs(
        "vllm-1t",
        "a",
        [
            {"ready_s": 20.0, "offline_seconds": [2.0], "num_output_tokens": 4000,
             "rss_tree_mb": 3000.0},
            {"1": _stream(400, 9, 2.5), "64": _stream(3000, 300, 15), "rss_tree_mb": 3100.0},
        ],
    )  # fmt: skip
    v2 = merge_runs(
        "vllm-2t",
        "a",
        [
            {"ready_s": 25.0, "offline_seconds": [1.6], "num_output_tokens": 4000},
            {"1": _stream(450, 7, 2.0), "64": _stream(3500, 250, 14)},
        ],
    )
    return [ours, v1, v2]


def test_merge_keeps_the_offline_ready_time_and_the_largest_memory() -> None:
    ours = _results()[0]
    assert ours.ready_s == 2.0  # the constructor of the offline run, not from_pretrained
    assert ours.offline_tok_s == pytest.approx(4000 / 2.0)  # the median run
    assert ours.rss_mb == 950.0
    assert ours.async_tok_s(64) == 5000 and ours.async_tok_s(16) is None


def test_batched_runs_of_one_batch_size_each_add_up() -> None:
    merged = merge_runs(
        "llama.cpp",
        "a",
        [{"batched": {"1": 100.0}}, {"batched": {"16": 400.0}}, {"batched": {"64": 600.0}}],
    )
    assert merged.data["batched"] == {"1": 100.0, "16": 400.0, "64": 600.0}
    served = merge_runs(
        "llama.cpp",
        "a",
        [{"serve": {"ready_s": 0.5, "1": {"tok_s": 9}}}, {"serve": {"ready_s": 0.7, "64": {}}}],
    )
    assert served.data["serve"] == {"ready_s": 0.5, "1": {"tok_s": 9}, "64": {}}


def test_best_vllm_takes_the_better_setting_per_figure() -> None:
    results = _results()
    by_name = {t.name: t for t in TARGETS}
    assert best_vllm(results, "a", by_name["offline throughput"]) == pytest.approx(2500)
    assert best_vllm(results, "a", by_name["TTFT p50 at 64 streams"]) == 250  # lower wins
    assert best_vllm(results, "a", by_name["time to ready"]) == 20.0
    assert best_vllm(results, "a", by_name["resident memory (tree)"]) == 3100.0  # only 1t has it
    assert best_vllm(results, "other model", by_name["time to ready"]) is None


def test_ratio_rows_say_which_targets_are_met() -> None:
    rows = {row[1]: row for row in ratio_rows([_results()])}
    assert rows["offline throughput"][5] == "0.80x" and "not met" in rows["offline throughput"][7]
    assert rows["offline throughput"][3] == "vLLM (better)"
    assert rows["throughput at 64 streams"][5] == "1.43x"
    assert rows["throughput at 64 streams"][7] == "met"
    assert rows["TTFT p50 at 64 streams"][5] == "0.40x"
    assert rows["TTFT p50 at 64 streams"][7] == "met"
    assert rows["one-stream inter-token p50"][5] == "1.50x"
    assert rows["time to ready"][5] == "0.10x" and rows["time to ready"][7] == "met"
    assert rows["resident memory (tree)"][7] == "met"  # 950 / 3100 = 0.31
    assert not any(name.startswith(("HTTP", "batched")) for name in rows)  # no llama.cpp here


def _llama_round(our_itl: float, our_64: float) -> list[PeerResult]:
    """One round of asyncengine and llama.cpp, through their servers and batched-bench."""
    ours = PeerResult(
        "asyncengine",
        "b",
        {"serve": {"ready_s": 3.0, "1": _stream(140, 40, our_itl), "64": _stream(our_64, 600, 50)},
         "batched": {"1": 140.0, "16": 880.0, "64": 1150.0}},
    )  # fmt: skip
    llama = PeerResult(
        "llama.cpp",
        "b",
        {"serve": {"ready_s": 1.0, "1": _stream(150, 50, 6.0), "64": _stream(500, 3000, 80)},
         "batched": {"1": 113.0, "16": 490.0, "64": 640.0}},
    )  # fmt: skip
    return [ours, llama]


def test_llama_cpp_targets_must_hold_in_every_round() -> None:
    rounds = [_llama_round(4.5, 1200), _llama_round(5.0, 1150), _llama_round(5.4, 700)]
    rows = {row[1]: row for row in ratio_rows(rounds)}
    itl = rows["HTTP one-stream inter-token p50"]
    assert itl[3] == "llama.cpp" and itl[2] == "5.00" and itl[4] == "6.00"
    assert itl[5] == "0.83x (0.75-0.90)"
    assert itl[7] == "**not met** (in 1/3 rounds)"  # 4.5 / 6 and only that round
    tput = rows["HTTP throughput at 64 streams"]
    assert tput[7] == "**not met** (in 2/3 rounds)"  # the 700 tok/s round is 1.4x
    assert rows["HTTP TTFT p50 at 64 streams"][7] == "met (in 3/3 rounds)"
    assert rows["batched offline, 1 sequence"][5].startswith("1.24x")
    assert rows["batched offline, 64 sequences"][7] == "met (in 3/3 rounds)"
    assert not any(name == "offline throughput" for name in rows)  # no vLLM in these rounds


def test_serve_and_batched_tables_list_only_engines_that_ran_them() -> None:
    results = [*_llama_round(5.0, 1200), *_results()]
    serve = serve_rows(results)
    assert [row[1] for row in serve] == ["asyncengine", "llama.cpp"]
    assert serve[0][2:6] == ["3.0", "140", "", "1,200"]
    assert serve[1][6] == "50.0 / 3,000.0"
    assert [row[1] for row in batched_rows(results)] == ["asyncengine", "llama.cpp"]
    assert batched_rows(results)[1][2:] == ["113", "490", "640"]
    # llama.cpp has no in-process figures: it is not in the engines' table
    assert [row[1] for row in figure_rows(results)] == ["asyncengine", "vllm-1t", "vllm-2t"]
    for header, rows in ((SERVE_HEADER, serve), (BATCHED_HEADER, batched_rows(results))):
        lines = markdown_table(header, rows).splitlines()
        assert all(line.count("|") == len(header) + 1 for line in lines)


def test_tables_are_well_formed_markdown() -> None:
    results = _results()
    for header, rows in (
        (FIGURE_HEADER, figure_rows(results)),
        (RATIO_HEADER, ratio_rows([results])),
    ):
        lines = markdown_table(header, rows).splitlines()
        assert len(lines) == 2 + len(rows)
        assert all(line.count("|") == len(header) + 1 for line in lines)
    assert figure_rows(results)[0][:4] == ["a", "asyncengine", "2.0", "2,000"]


def test_stream_stats_percentiles() -> None:
    records = [
        {"ttft": 0.010, "gaps": [0.002, 0.004], "tokens": 3},
        {"ttft": 0.030, "gaps": [0.006], "tokens": 2},
    ]
    stats = _stream_stats(records, wall=0.5)
    assert stats["tok_s"] == pytest.approx(10.0)
    assert stats["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert stats["itl_ms"]["p50"] == pytest.approx(4.0)
    assert stats["itl_ms"]["p99"] == pytest.approx(5.96)


def test_rounds_merge_to_the_median_of_each_figure() -> None:
    def one(ready: float, seconds: list[float], tok_s: float, ttft: float, rss: float) -> object:
        return merge_runs(
            "vllm-2t",
            "c",
            [
                {"ready_s": ready, "offline_seconds": seconds, "num_output_tokens": 4096,
                 "rss_tree_mb": rss, "threads_env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}},
                {"64": _stream(tok_s, ttft, 40.0), "rss_tree_mb": rss + 10},
            ],
        )  # fmt: skip

    merged = merge_rounds(
        [one(10.0, [4.0, 4.2, 4.4], 900, 1400, 3600), one(12.0, [4.1, 4.3, 4.5], 1000, 1200, 3700),
         one(11.0, [4.6, 4.7, 4.8], 800, 1500, 3650)]
    )  # fmt: skip
    assert (merged.engine, merged.model) == ("vllm-2t", "c")
    assert merged.ready_s == 11.0
    assert merged.offline_tok_s == pytest.approx(4096 / 4.4)  # the median of all nine runs
    assert merged.async_tok_s(64) == 900
    assert merged.latency_ms(64, "ttft_ms") == 1400
    assert merged.latency_ms(64, "ttft_ms", "p99") == 2800
    assert merged.rss_mb == 3710  # the largest sample of any round
    assert merged.data["threads_env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert merge_rounds([merged]).data == merged.data
    with pytest.raises(ValueError, match="at least one round"):
        merge_rounds([])


def test_rounds_alternate_the_engine_order() -> None:
    engines = ["asyncengine", "vllm-1t", "vllm-2t", "transformers"]
    assert round_order(engines, 0) == engines
    assert round_order(engines, 1) == engines[::-1]
    assert round_order(engines, 2) == engines


def test_a_round_runs_each_mode_of_every_engine_back_to_back_in_alternating_order() -> None:
    """The runs a ratio compares are adjacent (batched and serve: size by size),
    and each engine runs as often first as second over a round's slots and over two rounds."""
    engines, modes = ["asyncengine", "llama.cpp"], ["batched", "serve"]
    assert round_plan(engines, modes, 0) == [
        ("asyncengine", "batched", 1), ("llama.cpp", "batched", 1),
        ("llama.cpp", "batched", 16), ("asyncengine", "batched", 16),
        ("asyncengine", "batched", 64), ("llama.cpp", "batched", 64),
        ("llama.cpp", "serve", 1), ("asyncengine", "serve", 1),
        ("asyncengine", "serve", 16), ("llama.cpp", "serve", 16),
        ("llama.cpp", "serve", 64), ("asyncengine", "serve", 64),
    ]  # fmt: skip
    assert round_plan(engines, ["serve"], 1)[:2] == [
        ("llama.cpp", "serve", 1), ("asyncengine", "serve", 1),
    ]  # fmt: skip
    # an engine without a mode is left out of it; offline comes before async for each engine
    plan = round_plan(["asyncengine", "vllm-1t", "transformers"], ["offline", "async"], 0)
    assert plan == [
        ("asyncengine", "offline", None), ("vllm-1t", "offline", None),
        ("transformers", "offline", None),
        ("vllm-1t", "async", None), ("asyncengine", "async", None),
    ]  # fmt: skip


def _relabel(results: list[PeerResult], model: str) -> list[PeerResult]:
    return [PeerResult(r.engine, model, r.data) for r in results]


def test_a_gguf_run_has_issue_35s_bounds_against_llama_cpp() -> None:
    """The same figures pass the GGUF bounds (ITL <= 0.9x, 1 sequence >= 1.1x) and fail the
    bf16 ones (0.8x, 1.2x)."""
    bf16 = _relabel(_llama_round(5.1, 1200), "b: SmolLM2")
    gguf = _relabel(_llama_round(5.1, 1200), "b: SmolLM2, Q8_0 GGUF")
    for results in (bf16, gguf):
        results[1].data["batched"]["1"] = 120.0  # ours 140: 1.17x
    rows = {(row[0], row[1]): row for row in ratio_rows([[*bf16, *gguf]])}
    assert rows[("b: SmolLM2", "HTTP one-stream inter-token p50")][6] == "<= 0.8x"
    assert rows[("b: SmolLM2", "HTTP one-stream inter-token p50")][7] == "**not met**"
    assert rows[("b: SmolLM2, Q8_0 GGUF", "HTTP one-stream inter-token p50")][6] == "<= 0.9x"
    assert rows[("b: SmolLM2, Q8_0 GGUF", "HTTP one-stream inter-token p50")][7] == "met"
    assert rows[("b: SmolLM2", "batched offline, 1 sequence")][7] == "**not met**"
    assert rows[("b: SmolLM2, Q8_0 GGUF", "batched offline, 1 sequence")][7] == "met"
    names = [row[1] for row in ratio_rows([gguf])]
    assert len(names) == len(set(names))  # one row per figure, with the GGUF bound


def test_quantized_runs_are_measured_against_our_own_bf16_run() -> None:
    def ours(model: str, itl: float) -> PeerResult:
        return PeerResult("asyncengine", model, {"1": _stream(100, 10, itl)})

    rounds = [
        [ours("e: 1B", 30.0), ours("e: 1B, Q8_0 GGUF", 16.0), ours("e: 1B, Q4_K_M GGUF", 13.0)],
        [ours("e: 1B", 32.0), ours("e: 1B, Q8_0 GGUF", 20.0), ours("e: 1B, Q4_K_M GGUF", 11.0)],
    ]
    rows = {row[0]: row for row in ratio_rows(rounds) if "speed-up" in row[1]}
    q8, q4 = rows["e: 1B, Q8_0 GGUF"], rows["e: 1B, Q4_K_M GGUF"]
    assert q8[3] == "asyncengine bf16" and q8[6] == ">= 1.7x"
    assert q8[7] == "**not met** (in 1/2 rounds)"  # 30 / 16 = 1.88, 32 / 20 = 1.6
    assert q4[6] == ">= 2.5x" and q4[7] == "**not met** (in 1/2 rounds)"  # 2.31, 2.91
    assert "e: 1B" not in rows


def test_quant_names_are_checked() -> None:
    from benchmarks.peers.gguf_quant import parse_quants, quant_label

    assert parse_quants("Q8_0, q4_k_m") == ["q8_0", "q4_k_m"]
    assert parse_quants("") == []
    assert quant_label("q4_k_m") == "Q4_K_M GGUF"
    with pytest.raises(ValueError, match="--quant q3_k: choose from q8_0, q4_k_m"):
        parse_quants("q8_0,q3_k")
