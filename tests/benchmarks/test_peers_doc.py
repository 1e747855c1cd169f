"""`python -m benchmarks.peers --from-json RUN --update-doc DOC`: a saved run's tables go between
their machine kind's markers in the doc, and nothing else in the doc changes. No engine runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import harness, record
from benchmarks.peers.doc import begin_marker, end_marker, replace_region, update_doc

CPU = "AMD EPYC (family 26, model 2), 2 cores; AVX2, AVX-512, AVX512-BF16"
COMMAND = "python -m benchmarks.peers --model b --rounds 2"


def _stream(tok_s: float, ttft: float, itl: float) -> dict[str, Any]:
    return {
        "tok_s": tok_s,
        "ttft_ms": {"p50": ttft, "p99": ttft * 2},
        "itl_ms": {"p50": itl, "p99": itl * 3},
    }


def _round(our_itl: float, llama_itl: float, vllm_offline: float) -> list[dict[str, Any]]:
    model = "b: SmolLM2-135M-Instruct"
    return [
        {"engine": "asyncengine", "model": model, "ready_s": 0.5,
         "offline_seconds": [4.0], "num_output_tokens": 4096, "rss_tree_mb_runs": [900.0],
         "1": _stream(150, 20, our_itl), "64": _stream(1100, 700, 40),
         "serve": {"1": _stream(140, 25, our_itl), "64": _stream(1000, 750, 45)},
         "batched": {"1": 150.0, "64": 1150.0}},
        {"engine": "llama.cpp", "model": model,
         "serve": {"1": _stream(120, 30, llama_itl), "64": _stream(500, 2200, 90)},
         "batched": {"1": 120.0, "64": 600.0}},
        {"engine": "vllm-2t", "model": model, "ready_s": 15.0,
         "offline_seconds": [4096 / vllm_offline], "num_output_tokens": 4096,
         "rss_tree_mb_runs": [3600.0], "1": _stream(60, 40, 16.0), "64": _stream(750, 1700, 60)},
    ]  # fmt: skip


def _saved_run(path: Path) -> Path:
    rounds = [_round(6.0, 8.0, 800.0), _round(7.0, 8.0, 820.0)]
    path.write_text(
        json.dumps(
            {
                "meta": {"date": "2026-11-27", "cpu": CPU, "kind": "avx512-bf16",
                         "command": COMMAND, "repeats": 3},
                "results": rounds[0],
                "rounds": rounds,
            }
        )
    )  # fmt: skip
    return path


DOC = """# Performance

Text above the tables stays as it is.

{llama_begin}
an old llama.cpp table
{llama_end}

Between the two.

{vllm_begin}
an old vLLM table
{vllm_end}

{amx_begin}
the AMX machine's table, which a run on another kind leaves alone
{amx_end}

Text below stays too.
"""


def _doc(path: Path) -> Path:
    path.write_text(
        DOC.format(
            llama_begin=begin_marker("avx512-bf16", "llama.cpp"),
            llama_end=end_marker("avx512-bf16", "llama.cpp"),
            vllm_begin=begin_marker("avx512-bf16", "vllm"),
            vllm_end=end_marker("avx512-bf16", "vllm"),
            amx_begin=begin_marker("amx", "llama.cpp"),
            amx_end=end_marker("amx", "llama.cpp"),
        )
    )
    return path


def _outside_markers(text: str) -> str:
    """`text` with every marked region's content (not its markers) taken out."""
    out = []
    inside = False
    for line in text.splitlines():
        if line.startswith("<!-- peers:table:") and line.endswith("end -->"):
            inside = False
        if not inside:
            out.append(line)
        if line.startswith("<!-- peers:table:") and line.endswith("begin -->"):
            inside = line.startswith("<!-- peers:table:avx512-bf16")
    return "\n".join(out)


def test_from_json_update_doc_rewrites_only_this_kinds_regions(tmp_path: Path) -> None:
    run = _saved_run(tmp_path / "run.json")
    doc = _doc(tmp_path / "performance.md")
    before = doc.read_text()

    assert harness.main(["--from-json", str(run), "--update-doc", str(doc)]) == 0

    after = doc.read_text()
    assert _outside_markers(after) == _outside_markers(before)
    assert "the AMX machine's table, which a run on another kind leaves alone" in after
    assert "an old llama.cpp table" not in after and "an old vLLM table" not in after
    llama = after.split(begin_marker("avx512-bf16", "llama.cpp"))[1].split("end -->")[0]
    assert f"Measured 2026-11-27 on {CPU}; 2 rounds:" in llama
    assert f"```\n{COMMAND}\n```" in llama
    assert "| model | HTTP ITL p50, 1 stream (ms) | HTTP 64 streams (tok/s) |" in llama
    # one-stream ITL: 6 and 7 ms against 8 in the two rounds; the medians and the range
    assert "| b: asyncengine / llama.cpp | 6.50 / 8.00 | 1,000 / 500 |" in llama
    assert "| b: ratio | 0.81x (0.75-0.88) | 2.00x |" in llama  # no range where rounds agree
    vllm = after.split(begin_marker("avx512-bf16", "vllm"))[1].split("end -->")[0]
    assert "| b: asyncengine / vLLM | 1,024 / 810 |" in vllm  # vLLM's offline: 800 and 820


def test_a_run_again_replaces_its_own_table(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "performance.md")
    run = record.load(_saved_run(tmp_path / "run.json"))
    assert update_doc(doc, run) == ["avx512-bf16:llama.cpp", "avx512-bf16:vllm"]
    once = doc.read_text()
    update_doc(doc, run)
    assert doc.read_text() == once


def test_a_run_without_a_peer_leaves_that_peers_table(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "performance.md")
    data = json.loads(_saved_run(tmp_path / "run.json").read_text())
    for key in ("results", "rounds"):
        rounds = data[key] if key == "rounds" else [data[key]]
        for results in rounds:
            results[:] = [r for r in results if r["engine"] != "vllm-2t"]
    run = record.RunRecord.from_json(data)
    assert update_doc(doc, run) == ["avx512-bf16:llama.cpp"]
    assert "an old vLLM table" in doc.read_text()


def test_a_kind_without_markers_is_added_at_the_end(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\nNothing marked yet.\n")
    run = record.load(_saved_run(tmp_path / "run.json"))
    run.kind = "avx2"
    update_doc(doc, run)
    text = doc.read_text()
    assert text.startswith("# Performance\n\nNothing marked yet.\n\n<!-- peers:table:avx2:")
    assert text.endswith(end_marker("avx2", "vllm") + "\n")


def test_a_region_left_open_is_an_error() -> None:
    with pytest.raises(ValueError, match="has no"):
        replace_region("a\n<!-- begin -->\nb\n", "<!-- begin -->", "<!-- end -->", "new")


def test_a_saved_list_of_results_reads_as_one_round(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_round(6.0, 8.0, 800.0)))
    run = record.load(path)
    assert len(run.rounds) == 1 and [r.engine for r in run.results][:2] == [
        "asyncengine",
        "llama.cpp",
    ]
    assert run.command == record.UNRECORDED_COMMAND
    assert len(run.date) == 10  # the file's date, YYYY-MM-DD


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu sse2 {flags}

processor\t: 1
model name\t: ignored
"""


@pytest.mark.parametrize(
    ("flags", "kind", "features"),
    [
        (
            "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile",
            "amx",
            "AVX2, AVX-512, AVX512-BF16, AMX",
        ),
        ("avx2 fma avx512f avx512_bf16", "avx512-bf16", "AVX2, AVX-512, AVX512-BF16"),
        ("avx2 fma", "avx2", "AVX2"),
        ("", "other", "no AVX2"),
    ],
)
def test_the_cpu_kind_is_named_by_its_features(flags: str, kind: str, features: str) -> None:
    text = CPUINFO.format(vendor="AuthenticAMD", family=26, model=2, name="AMD EPYC", flags=flags)
    assert record.describe_cpu(text, 2) == (
        kind,
        f"AMD EPYC (family 26, model 2), 2 cores; {features}",
    )


def test_the_recorded_command_keeps_only_what_decides_the_measurement() -> None:
    argv = [
        "--model", "b", "--python", "vllm=/x/python", "--json", "out.json", "--update-doc",
        "--rounds", "3", "--plot-dir=docs/img", "--verbose", "--engines", "asyncengine",
    ]  # fmt: skip
    assert record.command_line(argv) == (
        "python -m benchmarks.peers --model b --rounds 3 --engines asyncengine"
    )
    assert record.command_line(["--update-doc", "docs/performance.md"]) == (
        "python -m benchmarks.peers"
    )
