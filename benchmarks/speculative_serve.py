"""What n-gram speculative decoding buys one stream through the server, against llama-server.

    python benchmarks/speculative_serve.py --model b [--rounds 3] [--k 4] [--json FILE]
        [--bench-dir DIR] [--gguf FILE] [--task NAME ...]

Issue 36's served measurement. Three servers, never two at once: `asyncengine serve` without
speculation ("plain"), `asyncengine serve --speculative-config` ("spec", the dict of
speculative.py) and llama.cpp's `llama-server --parallel 1` on the bf16 GGUF made by
llama.cpp's own converter from the same folder, each with the same compute threads. Each gets
speculative.py's input-grounded TASKS, one at a time, as streamed `/v1/chat/completions`
(the server applies the model's chat template), greedy, `max_tokens` as speculative.py.

A round starts each server in turn (the order alternates between rounds), sends it an
untimed warm-up request, then each task once; the table gives each task's best round.

Per stream, from the times the SSE chunks arrive:
- tokens/s: completion tokens over the seconds from the first token's chunk to the last's
  (decode only: the prompt's prefill is left out, as is the time to the first token);
- inter-token time (ITL): per token, (time of the last token − time of the first token) /
  (tokens after the first chunk). A speculative step emits several tokens in one chunk; a
  chunk-to-chunk median would count it as one long gap and several of zero, so the gap is
  spread over the tokens instead. Where the first chunk carries one token (as it does from
  all three servers) the divisor is tokens − 1.

The spec server's acceptance comes from its /metrics (draft tokens verified and accepted,
read before and after each request). Greedy text must be the same with and without
speculation, and the table says where it is not (bf16: a several-token verify chunk may round
differently from a one-token step).

Targets (issue 36, item 5), over the tasks together: spec tokens/s ≥ 1.8x plain, and spec ITL
≤ 0.5x llama-server's. Server logs go to `.bench/speculative-serve-*.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import CACHE_DIR, REPO_ROOT, describe, model_dir
from benchmarks.peers import llamacpp
from benchmarks.peers.http_load import greedy_stream_body, read_stream
from benchmarks.peers.servers import asyncengine_command, free_port, running_server
from benchmarks.speculative import TASKS

SERVERS = ("plain", "spec", "llama")
TARGET_SPEEDUP = 1.8  # spec tokens/s over plain's
TARGET_ITL_VS_LLAMA = 0.5  # spec ITL over llama-server's
DRAFTED_METRIC = "asyncengine_spec_decode_num_draft_tokens_total"
ACCEPTED_METRIC = "asyncengine_spec_decode_num_accepted_tokens_total"
WARMUP_PROMPT = "Say hello in five words."
LLAMA_CTX = 2048  # llama-server's one slot: a task's prompt and output with room to spare


# ---- one stream --------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatTally:
    """The tokens, text and chunk times of one streamed chat completion, fed its events.

    Counting (asyncengine puts a running `usage.completion_tokens` in every chunk when asked
    for `continuous_usage_stats`; llama-server ignores it and sends one chunk per token):
    1. A chunk with choices and a usage total moves the count to that total.
    2. Any other chunk whose delta has content adds one token.
    3. A usage-only chunk (no choices) corrects the total; when those tokens came is unknown.
    Role-only chunks (no content, no usage) add nothing.
    """

    tokens: int = 0
    text: str = ""
    first: float | None = None  # when the first token arrived
    first_tokens: int = 0  # tokens that came with it
    last: float | None = None  # when the last token arrived

    def add(self, event: dict[str, Any], now: float) -> None:
        """Account for `event`, which arrived at `now` (seconds, any monotonic clock)."""
        choices = event.get("choices") or []
        for choice in choices:
            delta = choice.get("delta") or {}
            self.text += delta.get("content") or ""
        usage = event.get("usage")
        total = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(total, int):
            k = total - self.tokens  # rules 1 and 3
            if not choices:
                self.tokens = max(self.tokens, total)
                return
        elif any((c.get("delta") or {}).get("content") for c in choices):
            k = 1  # rule 2
        else:
            return
        if k <= 0:
            return
        if self.first is None:
            self.first, self.first_tokens = now, k
        self.last = now
        self.tokens += k

    @property
    def decode_s(self) -> float:
        """Seconds from the first token's chunk to the last's."""
        if self.first is None or self.last is None:
            return 0.0
        return self.last - self.first

    @property
    def tok_s(self) -> float:
        """Completion tokens over `decode_s` (0 when the tokens came in one chunk)."""
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def itl_s(self) -> float | None:
        """Seconds per token after the first chunk's; None without such tokens."""
        after_first = self.tokens - self.first_tokens
        return self.decode_s / after_first if after_first > 0 else None


def chat_body(prompt: str, max_tokens: int, model: str | None = None) -> dict[str, Any]:
    """The request every server gets: one user turn, streamed, greedy, usage in every chunk."""
    return greedy_stream_body(max_tokens, model, messages=[{"role": "user", "content": prompt}])


async def stream_chat(
    base_url: str, prompt: str, max_tokens: int, model: str | None = None
) -> ChatTally:
    """One streamed chat completion; raises LoadError on a non-200 status or an error
    event."""
    import aiohttp

    tally = ChatTally()
    # A connection of its own, closed after: llama-server closes kept-alive connections.
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        session.post(
            base_url + "/v1/chat/completions", json=chat_body(prompt, max_tokens, model)
        ) as response,
    ):
        await read_stream(response, base_url, tally.add)
    return tally


# ---- the spec server's counters ----------------------------------------------------------------


def metric_total(text: str, name: str) -> float:
    """The sum of every series of metric `name` in a Prometheus text exposition (0 when it
    has none): one series per data-parallel rank."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series == name or series.startswith(name + "{"):
            total += float(value)
    return total


def spec_counters(base_url: str) -> tuple[float, float]:
    """(draft tokens verified, accepted) from GET /metrics; (0, 0) where it has none."""
    host_port = base_url.removeprefix("http://")
    conn = http.client.HTTPConnection(host_port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        text = response.read().decode() if response.status == 200 else ""
    finally:
        conn.close()
    return metric_total(text, DRAFTED_METRIC), metric_total(text, ACCEPTED_METRIC)


# ---- servers and rounds ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskRun:
    """One task's stream from one server in one round."""

    tokens: int
    tokens_after_first: int  # the tokens the ITL is spread over
    decode_s: float
    tok_s: float
    itl_ms: float | None
    text: str
    drafted: float = 0.0
    accepted: float = 0.0


def server_command(which: str, args: argparse.Namespace, port: int) -> list[str]:
    """The command line of server `which` (one of SERVERS) on 127.0.0.1:`port`."""
    if which == "llama":
        return llamacpp.server_command(
            args.llama, args.gguf, port, parallel=1, threads=args.threads, ctx_per_slot=LLAMA_CTX
        )
    extra = ["--num-threads", str(args.threads)]
    if which == "spec":
        extra += ["--speculative-config", json.dumps(spec_config(args))]
    return asyncengine_command(args.folder, port, served_model_name=args.model, extra_args=extra)


def spec_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": args.lookup_max}  # fmt: skip


def run_server(which: str, args: argparse.Namespace) -> dict[str, TaskRun]:
    """Start server `which`, warm it up, stream every task once; stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = CACHE_DIR / f"speculative-serve-{args.model}-{which}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # The server runs this checkout's asyncengine, whatever the caller's PYTHONPATH.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    model = None if which == "llama" else args.model
    runs: dict[str, TaskRun] = {}
    with running_server(server_command(which, args, port), base_url, env=env, log_path=log):
        asyncio.run(stream_chat(base_url, WARMUP_PROMPT, 8, model))
        for task in args.task:
            before = spec_counters(base_url) if which == "spec" else (0.0, 0.0)
            tally = asyncio.run(stream_chat(base_url, TASKS[task], args.max_tokens, model))
            after = spec_counters(base_url) if which == "spec" else (0.0, 0.0)
            itl = tally.itl_s
            runs[task] = TaskRun(
                tokens=tally.tokens, tokens_after_first=tally.tokens - tally.first_tokens,
                decode_s=tally.decode_s, tok_s=tally.tok_s,
                itl_ms=None if itl is None else itl * 1000, text=tally.text,
                drafted=after[0] - before[0], accepted=after[1] - before[1],
            )  # fmt: skip
    return runs


def best(runs: Sequence[TaskRun]) -> TaskRun:
    """The round with the most tokens per second."""
    return max(runs, key=lambda r: r.tok_s)


def task_row(task: str, runs: dict[str, list[TaskRun]]) -> dict[str, Any]:
    """One task's figures from every server's rounds (`runs[server]`, one per round)."""
    top = {which: best(runs[which]) for which in SERVERS}
    drafted = sum(r.drafted for r in runs["spec"])
    accepted = sum(r.accepted for r in runs["spec"])
    row: dict[str, Any] = {"task": task}
    for which, run in top.items():
        row[which] = asdict(run)
    row["speedup"] = _ratio(top["spec"].tok_s, top["plain"].tok_s)
    row["itl_vs_llama"] = _ratio(top["spec"].itl_ms, top["llama"].itl_ms)
    row["drafted"], row["accepted"] = drafted, accepted
    row["acceptance"] = accepted / drafted if drafted else None
    row["same_text"] = all(
        p.text == s.text for p, s in zip(runs["plain"], runs["spec"], strict=True)
    )
    return row


def together(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The tasks as one workload: each server's tokens over its summed decode seconds (best
    rounds), ITL as summed decode seconds over summed tokens after the first chunks, and the
    acceptance of every round's drafts."""
    out: dict[str, Any] = {"task": "the tasks together"}
    for which in SERVERS:
        tokens = sum(r[which]["tokens"] for r in rows)
        seconds = sum(r[which]["decode_s"] for r in rows)
        gaps = sum(r[which]["tokens_after_first"] for r in rows)
        out[which] = {
            "tokens": tokens,
            "tok_s": tokens / seconds if seconds > 0 else 0.0,
            "itl_ms": seconds / gaps * 1000 if gaps else None,
        }
    out["speedup"] = _ratio(out["spec"]["tok_s"], out["plain"]["tok_s"])
    out["itl_vs_llama"] = _ratio(out["spec"]["itl_ms"], out["llama"]["itl_ms"])
    drafted = sum(r["drafted"] for r in rows)
    out["drafted"] = drafted
    out["acceptance"] = sum(r["accepted"] for r in rows) / drafted if drafted else None
    out["same_text"] = all(r["same_text"] for r in rows)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table: per task and the tasks together."""

    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "n/a" if value is None else f"{value:{spec}}{suffix}"

    lines = [
        "| task | tokens | tok/s plain | tok/s spec | spec/plain (≥ 1.8x) | ITL ms spec | "
        "ITL ms llama-server | spec/llama ITL (≤ 0.5x) | acceptance | same text |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['plain']['tokens']} | {r['plain']['tok_s']:.1f} | "
            f"{r['spec']['tok_s']:.1f} | {fmt(r['speedup'], '.2f', 'x')} | "
            f"{fmt(r['spec']['itl_ms'], '.2f')} | {fmt(r['llama']['itl_ms'], '.2f')} | "
            f"{fmt(r['itl_vs_llama'], '.2f', 'x')} | {fmt(r['acceptance'], '.2f')} | "
            f"{'yes' if r['same_text'] else 'no'} |"
        )
    return "\n".join(lines)


# ---- the command line --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2, help="every server's compute threads")
    parser.add_argument("--task", action="append", choices=sorted(TASKS),
                        help="a task to run (repeatable; default: every task)")  # fmt: skip
    parser.add_argument("--bench-dir", type=Path, default=llamacpp.BENCH_DIR,
                        help="where llama.cpp is (or is built) and the GGUF is made")  # fmt: skip
    parser.add_argument("--gguf", type=Path, help="llama-server's model (default: the bf16 "
                        "GGUF of --model by llama.cpp's converter, under --bench-dir)")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.task = args.task or list(TASKS)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.folder = model_dir(args.model)
    args.llama = llamacpp.ensure_built(args.bench_dir)
    if args.gguf is None:
        args.gguf = llamacpp.to_gguf(args.llama, args.folder, args.bench_dir / "gguf" / args.model)

    runs: dict[str, dict[str, list[TaskRun]]] = {t: {w: [] for w in SERVERS} for t in args.task}
    for r in range(args.rounds):
        order = SERVERS if r % 2 == 0 else tuple(reversed(SERVERS))
        for which in order:
            for task, run in run_server(which, args).items():
                runs[task][which].append(run)
                print(f"round {r + 1}, {which}, {task}: {run.tokens} tokens, "
                      f"{run.tok_s:.1f} tok/s", flush=True)  # fmt: skip

    rows = [task_row(task, runs[task]) for task in args.task]
    rows.append(together(rows))
    print(f"\n{describe(args.model)}, bf16, {args.threads} threads, k={args.k}, "
          f"prompt_lookup_max={args.lookup_max}, one stream through each server, "
          f"best of {args.rounds} rounds; llama-server on {args.gguf.name}\n")  # fmt: skip
    print(markdown(rows))
    if args.json:
        saved = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        saved["llama"] = str(args.llama.server)
        args.json.write_text(json.dumps({"args": saved, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
