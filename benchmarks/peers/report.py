"""Tables and ratios for the peers harness (pure Python: unit-tested, no model runs).

A result is one engine on one model in one round: the merged JSON of its runs (offline and
async from runner.py, `batched` from the batched-bench shape, `serve` from the
HTTP load generator). The ratios compare asyncengine with a peer for each target: the better
of vLLM's settings ("better": higher throughput, lower latency, time and memory), or llama.cpp.
A target is met only when it holds in every round, not just in the median of the rounds.

A model whose label ends in " GGUF" ("b: SmolLM2-135M-Instruct, Q8_0 GGUF") is a quantized run
(`--quant`): asyncengine and llama.cpp on the same file, with issue 35's bounds against
llama.cpp, and asyncengine's speed-up over its own bf16 run of the model (`speedup_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.workload import median

CONCURRENCIES = (1, 16, 64)
OURS = "asyncengine"
VLLM_PREFIX = "vllm"
LLAMACPP = "llama.cpp"


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

    # ---- the HTTP server under the shared load generator (`serve` runs) ----

    @property
    def serve_ready_s(self) -> float | None:
        value = self.data.get("serve", {}).get("ready_s")
        return float(value) if value is not None else None

    def serve_stream(self, concurrency: int) -> dict[str, Any] | None:
        value = self.data.get("serve", {}).get(str(concurrency))
        return value if isinstance(value, dict) else None

    def serve_tok_s(self, concurrency: int) -> float | None:
        s = self.serve_stream(concurrency)
        return float(s["tok_s"]) if s and "tok_s" in s else None

    def serve_latency_ms(self, concurrency: int, what: str, q: str = "p50") -> float | None:
        s = self.serve_stream(concurrency)
        if not s or what not in s:
            return None
        return float(s[what][q])

    # ---- offline on llama-batched-bench's shape (`batched` runs) ----

    def batched_tok_s(self, batch: int) -> float | None:
        value = self.data.get("batched", {}).get(str(batch))
        return float(value) if value is not None else None


@dataclass(frozen=True, slots=True)
class Target:
    """asyncengine's figure over the peer's must be `>=` (higher is better) or `<=` `bound`."""

    name: str
    figure: Callable[[PeerResult], float | None]
    higher_is_better: bool
    bound: float  # the ratio asyncengine / peer must reach (>=) or stay under (<=)
    peer: str = VLLM_PREFIX  # "vllm": the better of vLLM's settings; else an engine's name
    models: str = "all"  # the models it applies to: "all", "bf16", or "gguf" (is_gguf)

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.higher_is_better else ratio <= self.bound

    def applies(self, model: str) -> bool:
        return self.models == "all" or (self.models == "gguf") == is_gguf(model)


def is_gguf(model: str) -> bool:
    """A quantized run's model label ("b: SmolLM2-135M-Instruct, Q8_0 GGUF")."""
    return model.endswith(" GGUF")


def base_model(model: str) -> str:
    """The label of the bf16 run a quantized run's label comes from."""
    return model.rsplit(", ", 1)[0] if is_gguf(model) else model


TARGETS: tuple[Target, ...] = (
    Target("offline throughput", lambda r: r.offline_tok_s, True, 1.3),
    Target("throughput at 64 streams", lambda r: r.async_tok_s(64), True, 1.3),
    Target("TTFT p50 at 64 streams", lambda r: r.latency_ms(64, "ttft_ms"), False, 0.5),
    Target("one-stream inter-token p50", lambda r: r.latency_ms(1, "itl_ms"), False, 0.8),
    Target("time to ready", lambda r: r.ready_s, False, 0.1),
    Target("resident memory (tree)", lambda r: r.rss_mb, False, 0.33),
    # Against llama.cpp: its server and ours under the same HTTP load generator, and offline
    # on llama-batched-bench's shape.
    Target(
        "HTTP one-stream inter-token p50",
        lambda r: r.serve_latency_ms(1, "itl_ms"),
        False,
        0.8,
        LLAMACPP,
        "bf16",
    ),
    Target(
        "HTTP one-stream inter-token p50",
        lambda r: r.serve_latency_ms(1, "itl_ms"),
        False,
        0.9,
        LLAMACPP,
        "gguf",
    ),
    Target("HTTP throughput at 64 streams", lambda r: r.serve_tok_s(64), True, 1.5, LLAMACPP),
    Target(
        "HTTP TTFT p50 at 64 streams",
        lambda r: r.serve_latency_ms(64, "ttft_ms"),
        False,
        1.0,
        LLAMACPP,
    ),
    Target(
        "batched offline, 1 sequence", lambda r: r.batched_tok_s(1), True, 1.2, LLAMACPP, "bf16"
    ),
    Target(
        "batched offline, 1 sequence", lambda r: r.batched_tok_s(1), True, 1.1, LLAMACPP, "gguf"
    ),
    Target("batched offline, 64 sequences", lambda r: r.batched_tok_s(64), True, 1.5, LLAMACPP),
)


def peer_figure(results: Sequence[PeerResult], model: str, target: Target) -> float | None:
    """The peer's figure for `target` on `model` (None without one): for vLLM, the better of
    its settings."""
    values = [
        v
        for r in results
        if r.model == model and _is_peer(r.engine, target.peer)
        for v in [target.figure(r)]
        if v is not None
    ]
    if not values:
        return None
    return max(values) if target.higher_is_better else min(values)


def best_vllm(results: Sequence[PeerResult], model: str, target: Target) -> float | None:
    """vLLM's better figure across its settings on `model` (None without a vLLM result)."""
    return peer_figure(results, model, replace(target, peer=VLLM_PREFIX))


def _is_peer(engine: str, peer: str) -> bool:
    return engine.startswith(peer + "-") or engine == peer


def ratio_rows(rounds: Sequence[Sequence[PeerResult]]) -> list[list[str]]:
    """One row per (model, target): ours, the peer's, the ratio, the bound, met or not.

    `rounds` holds each round's results. The figures shown are the medians over the rounds;
    the ratio is each round's own (median, and the range when there are several rounds), and
    a target is met only if every round met it.
    """
    rows = []
    models = models_of([r for results in rounds for r in results])
    for model in models:
        for t in TARGETS:
            per_round = target_rounds(rounds, model, t) if t.applies(model) else []
            if not per_round:
                continue
            peer = "vLLM (better)" if t.peer == VLLM_PREFIX else t.peer
            bound = f"{'>=' if t.higher_is_better else '<='} {t.bound}x"
            rows.append(_ratio_row(model, t.name, peer, per_round, t.met, bound))
    return rows + speedup_rows(rounds)


def _ratio_row(
    model: str,
    name: str,
    peer: str,
    per_round: Sequence[tuple[float, float, float]],
    met: Callable[[float], bool],
    bound: str,
    digits: int = 0,
) -> list[str]:
    """A ratio table row from each round's (ours, the peer's, the ratio): the medians, the
    ratio's range, and the verdict (met only if every round met it)."""
    ratios = [ratio for _, _, ratio in per_round]
    count = sum(met(ratio) for ratio in ratios)
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    verdict = "met" if count == len(ratios) else "**not met**"
    if len(ratios) > 1:
        verdict += f" (in {count}/{len(ratios)} rounds)"
    return [
        model,
        name,
        _num(median([m for m, _, _ in per_round]), digits),
        peer,
        _num(median([p for _, p, _ in per_round]), digits),
        f"{median(ratios):.2f}x{spread}",
        bound,
        verdict,
    ]


# asyncengine's one-stream speed-up on a quantized file over its own bf16 run of the model
# (issue 35): bf16's inter-token time over the file's, at least this much.
SPEEDUP_BOUNDS = {"Q8_0": 1.7, "Q4_K_M": 2.5}


def _one_stream_itl(r: PeerResult) -> float | None:
    return r.latency_ms(1, "itl_ms")


def speedup_rows(rounds: Sequence[Sequence[PeerResult]]) -> list[list[str]]:
    """Per quantized model: asyncengine's one-stream inter-token p50 (in-process) on the file
    against its bf16 run of the same model, as ratio_rows' rows (the ratio bf16 / quantized,
    which must reach SPEEDUP_BOUNDS)."""
    rows = []
    for model in models_of([r for results in rounds for r in results]):
        quant = model.rsplit(" ", 2)[-2] if is_gguf(model) else None
        if quant not in SPEEDUP_BOUNDS:
            continue
        per_round = []
        for results in rounds:
            figures = {
                r.model: _one_stream_itl(r)
                for r in results
                if r.engine == OURS and r.model in (model, base_model(model))
            }
            mine, bf16 = figures.get(model), figures.get(base_model(model))
            if mine and bf16:
                per_round.append((mine, bf16, bf16 / mine))
        if not per_round:
            continue
        bound = SPEEDUP_BOUNDS[quant]
        rows.append(
            _ratio_row(
                model, "one-stream inter-token p50, speed-up over bf16", "asyncengine bf16",
                per_round, lambda ratio, bound=bound: ratio >= bound, f">= {bound}x", digits=1,
            )
        )  # fmt: skip
    return rows


def target_rounds(
    rounds: Sequence[Sequence[PeerResult]], model: str, target: Target
) -> list[tuple[float, float, float]]:
    """(asyncengine's figure, the peer's, their ratio) for `target` on `model` in each round
    that has both figures."""
    per_round = []
    for results in rounds:
        ours = next((r for r in results if r.model == model and r.engine == OURS), None)
        mine = target.figure(ours) if ours is not None else None
        theirs = peer_figure(results, model, target)
        if mine is not None and theirs:
            per_round.append((mine, theirs, mine / theirs))
    return per_round


def figure_rows(results: Sequence[PeerResult]) -> list[list[str]]:
    """Every engine's raw figures, one row per (model, engine)."""
    rows = []
    for r in results:
        if r.offline_tok_s is None and not any(r.stream(c) for c in CONCURRENCIES):
            continue  # a peer measured only through its server or batched-bench (llama.cpp)
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


def serve_rows(results: Sequence[PeerResult]) -> list[list[str]]:
    """Every server's figures under the one HTTP load generator, one row per (model, engine)."""
    return [
        [
            r.model,
            r.engine,
            _num(r.serve_ready_s, 1),
            *(_num(r.serve_tok_s(c)) for c in CONCURRENCIES),
            _pair(r.serve_latency_ms(1, "ttft_ms"), r.serve_latency_ms(64, "ttft_ms")),
            _pair(r.serve_latency_ms(1, "itl_ms"), r.serve_latency_ms(1, "itl_ms", "p99")),
            _pair(r.serve_latency_ms(64, "itl_ms"), r.serve_latency_ms(64, "itl_ms", "p99")),
        ]
        for r in results
        if r.serve_stream(1) or r.serve_stream(64)
    ]


def batched_rows(results: Sequence[PeerResult]) -> list[list[str]]:
    """Offline output tokens/s on llama-batched-bench's shape, one row per (model, engine)."""
    return [
        [r.model, r.engine, *(_num(r.batched_tok_s(b)) for b in CONCURRENCIES)]
        for r in results
        if r.data.get("batched")
    ]


SERVE_HEADER = [
    "model",
    "server",
    "ready s",
    *(f"{c} stream{'s' if c > 1 else ''} tok/s" for c in CONCURRENCIES),
    "TTFT p50 ms (1 / 64)",
    "ITL ms 1 stream (p50 / p99)",
    "ITL ms 64 streams (p50 / p99)",
]
BATCHED_HEADER = ["model", "engine", *(f"{b} seq tok/s" for b in CONCURRENCIES)]

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
RATIO_HEADER = ["model", "figure", "asyncengine", "peer", "peer's", "ratio", "target", ""]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def merge_runs(engine: str, model: str, runs: Sequence[dict[str, Any]]) -> PeerResult:
    """One result from an engine's runs of one round (later keys win, except ready_s, which
    comes from the first run that has it: the offline constructor, and the batched and
    serve figures, which runs of one batch size or stream count each add to)."""
    data: dict[str, Any] = {}
    rss: list[float] = []
    for run in runs:
        for key, value in run.items():
            if key == "ready_s" and "ready_s" in data:
                continue
            if key == "rss_tree_mb":
                rss.append(float(value))
                continue
            if key in ("batched", "serve") and key in data:  # runs of one size each
                value = {**value, **data[key]}  # the first run's ready_s stays
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


def models_of(results: Sequence[PeerResult]) -> list[str]:
    """The models of `results`, in the order they first appear."""
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
