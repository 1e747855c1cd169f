"""The served speculation benchmark's pure parts: counting tokens and timing them from
recorded chat streams (a speculative step's several tokens in one chunk), reading the spec
counters from /metrics, the per-task and together figures, and the servers' command lines.
No server is started and nothing is timed here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.http_load import SSEParser
from benchmarks.peers.llamacpp import LlamaCpp
from benchmarks.speculative import TASKS
from benchmarks.speculative_serve import (
    ACCEPTED_METRIC,
    DRAFTED_METRIC,
    ChatTally,
    TaskRun,
    chat_body,
    markdown,
    metric_total,
    parse_args,
    server_command,
    task_row,
    together,
)

_ID = b'"id":"chatcmpl-79d6","object":"chat.completion.chunk","created":1795833874,"model":"b"'
_USAGE = b'"usage":{"prompt_tokens":39,"completion_tokens":%d,"total_tokens":%d}'

# `asyncengine serve --speculative-config` (SmolLM2, max_tokens 6, continuous usage; ids
# shortened): the role, the first token, then one verify step's five tokens in one chunk, then
# a usage-only chunk.
ASYNCENGINE_SPEC_CHUNKS = [
    b"data: {" + _ID + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null}],' + _USAGE % (0, 39) + b"}\n\n",
    b"data: {" + _ID + b',"choices":[{"index":0,"delta":{"content":"Repeat"},"logprobs":null,'
    b'"finish_reason":null,"stop_reason":null}],' + _USAGE % (1, 40) + b"}\n\n",
    b"data: {" + _ID + b',"choices":[{"index":0,"delta":{"content":" exactly: one two three"},'
    b'"logprobs":null,"finish_reason":"length","stop_reason":null}],' + _USAGE % (6, 45)
    + b"}\n\n",
    b"data: {" + _ID + b',"choices":[],' + _USAGE % (6, 45) + b"}\n\ndata: [DONE]\n\n",
]  # fmt: skip

_LLAMA = (
    b'"created":1795833903,"id":"chatcmpl-bFB8","model":"model-bf16.gguf",'
    b'"object":"chat.completion.chunk"'
)


def _llama_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"finish_reason": finish, "index": 0, "delta": delta}
    return b'data: {"choices":' + json.dumps([choice]).encode() + b"," + _LLAMA + b"}\n\n"


# llama.cpp's llama-server (b1-0c1e570, the same request): a role chunk with null content, a
# chunk per token without usage, the finish reason with an empty delta, then usage alone.
LLAMA_SERVER_CHUNKS = [
    _llama_chunk({"role": "assistant", "content": None}),
    *(_llama_chunk({"content": t}) for t in ("Repeat", " exactly", " one", " two", " three")),
    _llama_chunk({"content": " one"}),
    _llama_chunk({}, "length"),
    b'data: {"choices":[],' + _LLAMA + b',"usage":{"completion_tokens":6,"prompt_tokens":39,'
    b'"total_tokens":45}}\n\ndata: [DONE]\n\n',
]  # fmt: skip


def _tally(chunks: list[bytes], times: list[float]) -> ChatTally:
    parser, tally = SSEParser(), ChatTally()
    for chunk, now in zip(chunks, times, strict=True):
        for event in parser.feed(chunk):
            tally.add(event, now)
    return tally


def test_a_speculative_chunk_spreads_its_gap_over_its_tokens() -> None:
    # The role at 0.9 s, the first token at 1.0 s, five tokens at 1.1 s.
    tally = _tally(ASYNCENGINE_SPEC_CHUNKS, [0.9, 1.0, 1.1, 1.1])
    assert tally.tokens == 6
    assert tally.text == "Repeat exactly: one two three"
    assert tally.first_tokens == 1
    assert tally.decode_s == pytest.approx(0.1)
    assert tally.itl_s == pytest.approx(0.1 / 5)  # per token, not one 100 ms gap
    assert tally.tok_s == pytest.approx(60.0)


def test_llama_server_counts_a_token_per_chunk_and_not_its_role_or_finish() -> None:
    times = [1.0, 1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.2, 1.2]
    tally = _tally(LLAMA_SERVER_CHUNKS, times)
    assert tally.tokens == 6
    assert tally.text == "Repeat exactly one two three one"
    assert tally.decode_s == pytest.approx(0.05)  # the finish chunk's time is not a token's
    assert tally.itl_s == pytest.approx(0.01)


def test_a_usage_only_chunk_corrects_the_count() -> None:
    # A token whose text was held back (half a UTF-8 character) comes without a chunk.
    chunks = [
        _llama_chunk({"content": "a"}),
        _llama_chunk({"content": "b"}),
        LLAMA_SERVER_CHUNKS[-1],
    ]
    tally = _tally(chunks, [1.0, 1.5, 1.6])
    assert tally.tokens == 6
    assert tally.last == 1.5


def test_a_stream_with_one_chunk_has_no_itl() -> None:
    tally = _tally(ASYNCENGINE_SPEC_CHUNKS[:2], [1.0, 1.0])
    assert (tally.tokens, tally.itl_s, tally.tok_s) == (1, None, 0.0)


def test_chat_body_is_streamed_greedy_with_usage_in_every_chunk() -> None:
    body = chat_body("hi", 160, "b")
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["temperature"], body["max_tokens"], body["stream"]) == (0, 160, True)
    assert body["stream_options"]["continuous_usage_stats"] is True
    assert "model" not in chat_body("hi", 8)


METRICS = f"""# HELP {DRAFTED_METRIC} Speculative decoding: draft tokens verified.
# TYPE {DRAFTED_METRIC} counter
{DRAFTED_METRIC}{{model_name="b",engine="0"}} 34
{DRAFTED_METRIC}{{model_name="b",engine="1"}} 6
# TYPE {ACCEPTED_METRIC} counter
{ACCEPTED_METRIC}{{model_name="b",engine="0"}} 30.0
asyncengine_spec_decode_acceptance_rate{{model_name="b",engine="0"}} 0.88
"""


def test_metric_total_sums_every_rank_and_only_the_named_metric() -> None:
    assert metric_total(METRICS, DRAFTED_METRIC) == 40
    assert metric_total(METRICS, ACCEPTED_METRIC) == 30
    assert metric_total(METRICS, "asyncengine_spec_decode") == 0
    assert metric_total("", DRAFTED_METRIC) == 0


def _run(
    tokens: int, decode_s: float, text: str = "x", drafted: int = 0, accepted: int = 0
) -> TaskRun:
    return TaskRun(tokens=tokens, tokens_after_first=tokens - 1, decode_s=decode_s,
                   tok_s=tokens / decode_s, itl_ms=decode_s / (tokens - 1) * 1000, text=text,
                   drafted=drafted, accepted=accepted)  # fmt: skip


def test_task_rows_take_each_servers_best_round_and_the_tasks_together_their_sums() -> None:
    a = task_row("a", {
        "plain": [_run(11, 0.2), _run(11, 0.1)],
        "spec": [_run(11, 0.05, drafted=8, accepted=6), _run(11, 0.06, drafted=8, accepted=6)],
        "llama": [_run(11, 0.2), _run(11, 0.3)],
    })  # fmt: skip
    assert a["speedup"] == pytest.approx(2.0)
    assert a["itl_vs_llama"] == pytest.approx(0.25)
    assert a["acceptance"] == pytest.approx(0.75)
    assert a["same_text"]
    b = task_row("b", {
        "plain": [_run(21, 0.2, "one")],
        "spec": [_run(21, 0.2, "two", drafted=4, accepted=0)],
        "llama": [_run(21, 0.4)],
    })  # fmt: skip
    assert b["speedup"] == pytest.approx(1.0)
    assert not b["same_text"]
    both = together([a, b])
    assert both["plain"]["tok_s"] == pytest.approx(32 / 0.3)
    assert both["speedup"] == pytest.approx((32 / 0.25) / (32 / 0.3))
    assert both["itl_vs_llama"] == pytest.approx((0.25 / 30) / (0.6 / 30))
    assert both["acceptance"] == pytest.approx(12 / 20)  # every round of every task
    assert not both["same_text"]
    table = markdown([a, b, both])
    assert "| a | 11 | 110.0 | 220.0 | 2.00x |" in table
    assert table.count("\n") == 4


def test_arguments() -> None:
    args = parse_args([])
    assert (args.model, args.rounds, args.k, args.max_tokens, args.threads) == ("b", 3, 4, 160, 2)
    assert args.task == list(TASKS)
    args = parse_args(["--task", "quote", "--task", "rename", "--rounds", "1", "--k", "6"])
    assert (args.task, args.rounds, args.k) == (["quote", "rename"], 1, 6)
    with pytest.raises(SystemExit):
        parse_args(["--task", "no-such-task"])
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_server_commands() -> None:
    args = parse_args(["--threads", "3", "--k", "5"])
    args.folder, args.gguf = Path("/models/b"), Path("/gguf/model-bf16.gguf")
    args.llama = LlamaCpp(Path("/llama.cpp"))
    plain = server_command("plain", args, 8000)
    spec = server_command("spec", args, 8000)
    llama = server_command("llama", args, 8000)
    assert "--speculative-config" not in plain
    config = json.loads(spec[spec.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 4}  # fmt: skip
    assert spec[: len(plain)] == plain
    assert plain[plain.index("--num-threads") + 1] == "3"
    assert llama[llama.index("-np") + 1] == "1"
    assert llama[llama.index("-t") + 1] == "3"
    assert "/gguf/model-bf16.gguf" in llama
