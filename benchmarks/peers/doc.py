"""The peers tables of docs/performance.md: one per machine kind and peer, between markers.

    python -m benchmarks.peers [run options] --update-doc           # after a run
    python -m benchmarks.peers --from-json run.json --update-doc    # from a saved run

A run on an AVX512-BF16 machine with llama.cpp among its engines replaces what lies between

    <!-- peers:table:avx512-bf16:llama.cpp begin -->
    <!-- peers:table:avx512-bf16:llama.cpp end -->

with the run's date, CPU, command and table, and likewise for vLLM; nothing else in the file
changes. A region the file does not have yet is added at its end, for an editor to move.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.peers.record import RunRecord
from benchmarks.peers.report import (
    LLAMACPP,
    TARGETS,
    VLLM_PREFIX,
    markdown_table,
    models_of,
    target_rounds,
)
from benchmarks.workload import median

# (the name in the markers, Target.peer, the name in the table)
PEERS = (("llama.cpp", LLAMACPP, "llama.cpp"), ("vllm", VLLM_PREFIX, "vLLM"))
# Each target's column heading, with its unit.
COLUMNS = {
    "HTTP one-stream inter-token p50": "HTTP ITL p50, 1 stream (ms)",
    "HTTP throughput at 64 streams": "HTTP 64 streams (tok/s)",
    "HTTP TTFT p50 at 64 streams": "HTTP TTFT p50 @64 (ms)",
    "batched offline, 1 sequence": "offline 1 seq (tok/s)",
    "batched offline, 64 sequences": "offline 64 seq (tok/s)",
    "offline throughput": "offline (tok/s)",
    "throughput at 64 streams": "64 streams (tok/s)",
    "TTFT p50 at 64 streams": "TTFT p50 @64 (ms)",
    "one-stream inter-token p50": "ITL p50, 1 stream (ms)",
    "time to ready": "ready (s)",
    "resident memory (tree)": "tree RSS (MB)",
}


def begin_marker(kind: str, peer: str) -> str:
    return f"<!-- peers:table:{kind}:{peer} begin -->"


def end_marker(kind: str, peer: str) -> str:
    return f"<!-- peers:table:{kind}:{peer} end -->"


def peer_table(record: RunRecord, peer: str) -> str | None:
    """The markdown table of asyncengine against `peer` ("llama.cpp" or "vllm") in `record`:
    per model, both engines' figures (medians of the rounds) and the ratio (the median of
    each round's own, its range in brackets); None where the run has no such pairs."""
    _, target_peer, label = next(p for p in PEERS if p[0] == peer)
    # one column per figure: a GGUF-only target repeats a bf16 one's figure with its own bound
    targets = [t for t in TARGETS if t.peer == target_peer and t.models != "gguf"]
    rows = []
    for model in models_of(record.results):
        per_target = [target_rounds(record.rounds, model, t) for t in targets]
        if not any(per_target):
            continue
        short = model.split(":")[0]
        rows.append([f"{short}: asyncengine / {label}", *map(_figures, per_target)])
        rows.append([f"{short}: ratio", *map(_ratio, per_target)])
    if not rows:
        return None
    return markdown_table(["model", *(COLUMNS.get(t.name, t.name) for t in targets)], rows)


def region(record: RunRecord, peer: str) -> str | None:
    """The whole marked region for `peer`: markers, date, CPU, command, table."""
    table = peer_table(record, peer)
    if table is None:
        return None
    rounds = len(record.rounds)
    return "\n".join(
        [
            begin_marker(record.kind, peer),
            f"Measured {record.date} on {record.cpu}; {rounds} round{'s' if rounds != 1 else ''}:",
            "",
            "```",
            record.command,
            "```",
            "",
            table,
            end_marker(record.kind, peer),
        ]
    )


def update_doc(doc: Path, record: RunRecord) -> list[str]:
    """Write `record`'s tables into `doc` between their markers; the regions written."""
    text = doc.read_text()
    written = []
    for peer, _, _ in PEERS:
        block = region(record, peer)
        if block is None:
            continue
        text = replace_region(
            text, begin_marker(record.kind, peer), end_marker(record.kind, peer), block
        )
        written.append(f"{record.kind}:{peer}")
    doc.write_text(text)
    return written


def replace_region(text: str, begin: str, end: str, block: str) -> str:
    """`text` with `begin` ... `end` (markers included) replaced by `block`; `block` appended
    at the end where `begin` is absent. A `begin` without its `end` is an error, not a guess."""
    start = text.find(begin)
    if start < 0:
        return text.rstrip("\n") + f"\n\n{block}\n"
    stop = text.find(end, start)
    if stop < 0:
        raise ValueError(f"{begin} has no {end} after it")
    return text[:start] + block + text[stop + len(end) :]


def _figures(per_round: list[tuple[float, float, float]]) -> str:
    if not per_round:
        return ""
    ours = median([mine for mine, _, _ in per_round])
    theirs = median([peer for _, peer, _ in per_round])
    return f"{_number(ours)} / {_number(theirs)}"


def _ratio(per_round: list[tuple[float, float, float]]) -> str:
    if not per_round:
        return ""
    ratios = [ratio for _, _, ratio in per_round]
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    spread = f" ({low}-{high})" if low != high else ""  # rounds that differ, and how far
    return f"{median(ratios):.2f}x{spread}"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
