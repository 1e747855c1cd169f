"""Tables and ratios for `benchmarks/peers.py` (pure Python: unit-tested, no model runs).

A result is one engine on one model: the merged JSON of its offline and async runs
(benchmarks/peer_runner.py). The ratios compare asyncengine with the better of vLLM's
settings for each figure ("better": higher throughput, lower latency, time and memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import median

CONCURRENCIES = (1, 16, 64)
OURS = "asyncengine"
VLLM_PREFIX = "vllm"


@dataclass(slots=True)
class PeerResult:
    engine: str  # asyncengine | vllm-1t | vllm-2t | transformers
    model: str
    data: dict[str, Any] = field(default_factory=dict)

    # ---- figures (None where the engine has no such run) ----

    @property
    def ready_s(self) -> float | None:
        value = self.data.get("ready_s")
        return float(value) if value is not None else None

    @property
    def offline_tok_s(self) -> float | None:
        seconds = self.data.get("offline_seconds")
        if not seconds:
            return None
        return float(self.data["num_output_tokens"]) / median(seconds)

    def stream(self, concurrency: int) -> dict[str, Any] | None:
        value = self.data.get(str(concurrency))
        return value if isinstance(value, dict) else None

    def async_tok_s(self, concurrency: int) -> float | None:
        s = self.stream(concurrency)
        return float(s["tok_s"]) if s and "tok_s" in s else None

    def latency_ms(self, concurrency: int, what: str, q: str = "p50") -> float | None:
        s = self.stream(concurrency)
        if not s or what not in s:
            return None
        return float(s[what][q])

    @property
    def rss_mb(self) -> float | None:
        values = [v for v in self.data.get("rss_tree_mb_runs", []) if v]
        return max(values) if values else None


@dataclass(frozen=True, slots=True)
class Target:
    """asyncengine's figure over vLLM's better one must be `op` `bound`."""

    name: str
    figure: Callable[[PeerResult], float | None]
    higher_is_better: bool
    bound: float  # the ratio asyncengine / vLLM must reach (>=) or stay under (<=)


TARGETS: tuple[Target, ...] = (
    Target("offline throughput", lambda r: r.offline_tok_s, True, 1.3),
    Target("throughput at 64 streams", lambda r: r.async_tok_s(64), True, 1.3),
    Target("TTFT p50 at 64 streams", lambda r: r.latency_ms(64, "ttft_ms"), False, 0.5),
    Target("one-stream inter-token p50", lambda r: r.latency_ms(1, "itl_ms"), False, 0.8),
    Target("time to ready", lambda r: r.ready_s, False, 0.1),
    Target("resident memory (tree)", lambda r: r.rss_mb, False, 0.33),
)


def best_vllm(results: Sequence[PeerResult], model: str, target: Target) -> float | None:
    """vLLM's better figure across its settings on `model` (None without a vLLM result)."""
    values = [
        v
        for r in results
        if r.model == model and r.engine.startswith(VLLM_PREFIX)
        for v in [target.figure(r)]
        if v is not None
    ]
    if not values:
        return None
    return max(values) if target.higher_is_better else min(values)


def ratio_rows(results: Sequence[PeerResult]) -> list[list[str]]:
    """One row per (model, target): ours, vLLM's better, the ratio, the bound, met or not."""
    rows = []
    for model in _models(results):
        ours = next((r for r in results if r.model == model and r.engine == OURS), None)
        if ours is None:
            continue
        for t in TARGETS:
            mine, theirs = t.figure(ours), best_vllm(results, model, t)
            if mine is None or theirs is None or theirs == 0:
                continue
            ratio = mine / theirs
            met = ratio >= t.bound if t.higher_is_better else ratio <= t.bound
            rows.append(
                [
                    model,
                    t.name,
                    _num(mine),
                    _num(theirs),
                    f"{ratio:.2f}x",
                    f"{'>=' if t.higher_is_better else '<='} {t.bound}x",
                    "met" if met else "**not met**",
                ]
            )
    return rows


def figure_rows(results: Sequence[PeerResult]) -> list[list[str]]:
    """Every engine's raw figures, one row per (model, engine)."""
    rows = []
    for r in results:
        rows.append(
            [
                r.model,
                r.engine,
                _num(r.ready_s, 1),
                _num(r.offline_tok_s),
                *(_num(r.async_tok_s(c)) for c in CONCURRENCIES),
                _pair(r.latency_ms(1, "ttft_ms"), r.latency_ms(64, "ttft_ms")),
                _pair(r.latency_ms(1, "itl_ms"), r.latency_ms(1, "itl_ms", "p99")),
                _pair(r.latency_ms(64, "itl_ms"), r.latency_ms(64, "itl_ms", "p99")),
                _num(r.rss_mb),
            ]
        )
    return rows


FIGURE_HEADER = [
    "model",
    "engine",
    "ready s",
    "offline tok/s",
    *(f"{c} stream{'s' if c > 1 else ''} tok/s" for c in CONCURRENCIES),
    "TTFT p50 ms (1 / 64)",
    "ITL ms 1 stream (p50 / p99)",
    "ITL ms 64 streams (p50 / p99)",
    "tree RSS MB",
]
RATIO_HEADER = ["model", "figure", "asyncengine", "vLLM (better)", "ratio", "target", ""]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def merge_runs(engine: str, model: str, runs: Sequence[dict[str, Any]]) -> PeerResult:
    """One result from an engine's offline and async runs (later keys win, except ready_s,
    which comes from the first run that has it: the offline constructor)."""
    data: dict[str, Any] = {}
    rss: list[float] = []
    for run in runs:
        for key, value in run.items():
            if key == "ready_s" and "ready_s" in data:
                continue
            if key == "rss_tree_mb":
                rss.append(float(value))
                continue
            data[key] = value
    data["rss_tree_mb_runs"] = rss
    return PeerResult(engine=engine, model=model, data=data)


def merge_rounds(rounds: Sequence[PeerResult]) -> PeerResult:
    """One result from the same engine and model measured in several rounds: each figure the
    median of the rounds' (timed offline runs and memory samples pooled; other values from
    the first round), so a minute when the machine was slower moves no engine's figures
    alone."""
    if not rounds:
        raise ValueError("merge_rounds needs at least one round")
    return PeerResult(
        engine=rounds[0].engine,
        model=rounds[0].model,
        data=_median_of([r.data for r in rounds]),
    )


def _median_of(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict, list)):
        return first
    if isinstance(first, (int, float)):
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        return median(numbers) if len(numbers) == len(values) else first
    if isinstance(first, list):
        return [item for v in values if isinstance(v, list) for item in v]
    keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
    return {k: _median_of([v[k] for v in values]) for k in keys}


def _models(results: Sequence[PeerResult]) -> list[str]:
    seen: list[str] = []
    for r in results:
        if r.model not in seen:
            seen.append(r.model)
    return seen


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return ""
    return f"{value:,.{digits}f}" if value >= 10 or digits else f"{value:.2f}"


def _pair(a: float | None, b: float | None) -> str:
    if a is None and b is None:
        return ""
    return f"{_num(a, 1) or '-'} / {_num(b, 1) or '-'}"
