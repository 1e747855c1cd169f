"""Prometheus metrics of the server, in the text exposition format (written by hand: a few
counters and histograms do not need prometheus_client).

Two sources:

- the engine core's snapshot (`AsyncLLM.get_stats()`), read at each scrape: requests running
  and waiting, KV cache usage, prefix-cache queries and hits, preemptions;
- the server's own view of every stream, updated as outputs arrive (`RequestTracker`): prompt
  and generation token counters, finished choices by reason, and the latency histograms, timed
  from the moment the server accepted the request to the moment each output reached it.

With several API server processes (`serve --api-server-count K`), each writes its own counts
to a file in a shared directory (every half second, and at each scrape), and a scrape of any
of them reports the sum over all, plus each process's request count (`api_server` label).
"""

from __future__ import annotations

import bisect
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncengine.ipc.messages import EngineStats
from asyncengine.outputs import RequestOutput

PREFIX = "asyncengine_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

# Bucket bounds in seconds, close to vLLM's so dashboards carry over.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 240.0, 480.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket (not cumulative), then +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def add(self, other: dict[str, Any]) -> None:
        """Add another process's counts of this histogram (from `snapshot()`)."""
        for i, n in enumerate(other["counts"]):
            self.counts[i] += n
        self.sum += other["sum"]
        self.count += other["count"]

    def snapshot(self) -> dict[str, Any]:
        return {"counts": self.counts, "sum": self.sum, "count": self.count}

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` `times` times (a merged output carries several token gaps)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, labels: str) -> list[str]:
        lines = _header(self.name, self.help, "histogram")
        cumulative = 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts, strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum!r}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


class ServerMetrics:
    """Counters and histograms of one server; updated on the event loop's thread only."""

    def __init__(
        self, model_name: str, *, shared_dir: str | None = None, process_index: int = 0
    ) -> None:
        self.model_name = model_name
        self.shared_dir = shared_dir  # several API server processes share their counts here
        self.process_index = process_index
        self.num_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from the server accepting a request to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a sequence.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from the server accepting a request to its end (finished or aborted).",
            E2E_BUCKETS,
        )

    def track(self, num_prompt_tokens: int, num_sequences: int, arrival: float) -> RequestTracker:
        """Start tracking one engine request (one prompt, `num_sequences` choices)."""
        self.prompt_tokens += num_prompt_tokens
        self.num_requests += 1
        return RequestTracker(self, arrival, num_sequences)

    def snapshot(self) -> dict[str, Any]:
        """This process's counts, for the other API server processes."""
        return {
            "index": self.process_index,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished": self.finished,
            "histograms": [h.snapshot() for h in (self.ttft, self.itl, self.e2e)],
        }

    def write_snapshot(self) -> None:
        """Share this process's counts (atomically: a reader never sees half a file)."""
        if self.shared_dir is None:
            return
        path = Path(self.shared_dir) / f"api-server-{self.process_index}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, path)

    def _merged(self) -> tuple[ServerMetrics, dict[int, int]]:
        """Every API server process's counts summed (this one's fresh), and each one's
        request count by index."""
        self.write_snapshot()
        assert self.shared_dir is not None
        total = ServerMetrics(self.model_name)
        per_process: dict[int, int] = {}
        for path in sorted(Path(self.shared_dir).glob("api-server-*.json")):
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced: the next scrape reads it
            per_process[int(snap["index"])] = int(snap["num_requests"])
            total.prompt_tokens += snap["prompt_tokens"]
            total.generation_tokens += snap["generation_tokens"]
            for reason, count in snap["finished"].items():
                total.finished[reason] = total.finished.get(reason, 0) + count
            for histogram, other in zip(
                (total.ttft, total.itl, total.e2e), snap["histograms"], strict=True
            ):
                histogram.add(other)
        return total, per_process

    def render(self, stats: EngineStats | None) -> str:
        """The exposition text; the engine's gauges are left out when `stats` is None (the
        engine is not running, so there is nothing to report for it)."""
        labels = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []
        if stats is not None:
            lines += _engine_lines(stats, labels)
        if self.shared_dir is None:
            lines += self._server_lines(labels)
        else:
            total, per_process = self._merged()
            lines += total._server_lines(labels)
            name = PREFIX + "api_server_requests_total"
            lines += _header(name, "Requests accepted by each API server process.", "counter")
            for index, count in sorted(per_process.items()):
                lines.append(f'{name}{{{labels},api_server="{index}"}} {count}')
        return "\n".join(lines) + "\n"

    def _server_lines(self, labels: str) -> list[str]:
        lines: list[str] = []
        lines += _header(PREFIX + "prompt_tokens_total", "Prompt tokens accepted.", "counter")
        lines.append(f"{PREFIX}prompt_tokens_total{{{labels}}} {self.prompt_tokens}")
        lines += _header(PREFIX + "generation_tokens_total", "Tokens generated.", "counter")
        lines.append(f"{PREFIX}generation_tokens_total{{{labels}}} {self.generation_tokens}")
        name = PREFIX + "request_success_total"
        lines += _header(name, "Choices (sequences) finished, by finish reason.", "counter")
        for reason, count in self.finished.items():
            lines.append(f'{name}{{{labels},finished_reason="{reason}"}} {count}')
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(labels)
        return lines


# The engine's metrics: name, kind, help, and the EngineStats field each reads.
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "gauge", "Requests in the engine's running batch.",
     "num_running_reqs"),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting_reqs"),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
     "kv_cache_usage"),
    ("kv_cache_blocks", "gauge", "KV cache blocks allocated by the engine.", "num_kv_blocks"),
    ("prefix_cache_hit_rate", "gauge",
     "Fraction of prompt tokens found in the prefix cache, since start.",
     "prefix_cache_hit_rate"),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
     "prefix_cache_hits"),
    ("num_preemptions_total", "counter", "Requests preempted to free KV cache blocks.",
     "num_preemptions"),
    ("spec_decode_num_draft_tokens_total", "counter",
     "Speculative decoding: draft tokens verified.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative decoding: draft tokens accepted.", "num_accepted_tokens"),
    ("spec_decode_acceptance_rate", "gauge",
     "Speculative decoding: fraction of draft tokens accepted, since start.",
     "spec_acceptance_rate"),
    ("spec_decode_num_turn_downs_total", "counter",
     "Speculative decoding: times a request's failing drafts paused its drafting.",
     "num_spec_turn_downs"),
)  # fmt: skip
# Per draft position (label `position`, 0: a step's first draft), as vLLM's per-position counter.
_PER_POSITION_METRICS = (
    ("spec_decode_num_drafts_per_pos_total", "Speculative decoding: drafts verified, by position.",
     "spec_drafts_per_position"),
    ("spec_decode_num_accepted_tokens_per_pos_total",
     "Speculative decoding: drafts accepted, by position.", "spec_accepted_per_position"),
)  # fmt: skip


def _engine_lines(stats: EngineStats, labels: str) -> list[str]:
    """The engine's gauges and counters, one series per data-parallel rank (label `engine`;
    "0" without data parallel). A dead rank has no series."""
    ranks = stats.ranks or (stats,)
    lines: list[str] = []
    for name, kind, help_text, field_name in _ENGINE_METRICS:
        lines += _header(PREFIX + name, help_text, kind)
        for rank_stats in ranks:
            value = getattr(rank_stats, field_name)
            rank = rank_stats.data_parallel_rank or 0
            lines.append(f'{PREFIX}{name}{{{labels},engine="{rank}"}} {value!r}')
    for name, help_text, field_name in _PER_POSITION_METRICS:
        lines += _header(PREFIX + name, help_text, "counter")
        for rank_stats in ranks:
            rank = rank_stats.data_parallel_rank or 0
            for position, value in enumerate(getattr(rank_stats, field_name)):
                lines.append(
                    f'{PREFIX}{name}{{{labels},engine="{rank}",position="{position}"}} {value}'
                )
    return lines


@dataclass(slots=True, eq=False)
class RequestTracker:
    """One engine request's timing, fed with its DELTA outputs as the server receives them."""

    metrics: ServerMetrics
    arrival: float
    num_sequences: int
    first_token_seen: bool = False
    last_token_time: dict[int, float] = field(default_factory=dict)  # by sequence index
    num_finished: int = 0

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        for completion in output.outputs:
            k = len(completion.token_ids)
            if k:
                m.generation_tokens += k
                last = self.last_token_time.get(completion.index)
                if last is None:
                    if not self.first_token_seen:
                        self.first_token_seen = True
                        m.ttft.observe(now - self.arrival)
                    # Tokens merged into a sequence's first output have no gap to measure.
                else:
                    # A merged DELTA output carries k tokens: k gaps of equal share.
                    m.itl.observe((now - last) / k, k)
                self.last_token_time[completion.index] = now
            if completion.finish_reason is not None:
                reason = completion.finish_reason
                m.finished[reason] = m.finished.get(reason, 0) + 1
                self.num_finished += 1

    def close(self) -> None:
        """The request's stream is over: sequences that never finished were aborted."""
        m = self.metrics
        unfinished = self.num_sequences - self.num_finished
        if unfinished > 0:
            m.finished["abort"] += unfinished
        m.e2e.observe(time.monotonic() - self.arrival)


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
