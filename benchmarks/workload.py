"""The one benchmark workload every engine runs, and the helpers that report on it.

Pure Python (no torch, no numpy): cheap to import in the parent process and in unit tests.
Every engine, in every run, gets the same prompts: they come from a private `random.Random`
seeded with a fixed value, never from the global RNG.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The workload: 64 requests, prompts of 32–128 random tokens, 64 greedy output tokens each,
# EOS ignored so that every request generates exactly `output_len` tokens, bf16 weights.
NUM_REQUESTS = 64
MIN_PROMPT_LEN = 32
MAX_PROMPT_LEN = 128
OUTPUT_LEN = 64
DTYPE = "bfloat16"
SEED = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts plus the generation settings shared by every engine."""

    prompts: list[list[int]]
    output_len: int = OUTPUT_LEN
    dtype: str = DTYPE
    greedy: bool = True
    ignore_eos: bool = True

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return self.num_requests * self.output_len


def make_workload(
    vocab_size: int,
    special_ids: Iterable[int] = (),
    *,
    num_requests: int = NUM_REQUESTS,
    min_prompt_len: int = MIN_PROMPT_LEN,
    max_prompt_len: int = MAX_PROMPT_LEN,
    output_len: int = OUTPUT_LEN,
    seed: int = SEED,
) -> Workload:
    """The benchmark workload for a model with `vocab_size` ids, never using `special_ids`.

    Prompt lengths are uniform in [min_prompt_len, max_prompt_len] (inclusive) and token ids
    uniform over the non-special ids in [0, vocab_size). The same arguments always give the
    same prompts.
    """
    if not 0 < min_prompt_len <= max_prompt_len:
        raise ValueError(
            f"prompt lengths must satisfy 0 < min <= max, got {min_prompt_len}..{max_prompt_len}"
        )
    allowed = _allowed_ids(vocab_size, special_ids)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        length = rng.randint(min_prompt_len, max_prompt_len)
        prompts.append([allowed[rng.randrange(len(allowed))] for _ in range(length)])
    return Workload(prompts=prompts, output_len=output_len)


def fresh_tokens(wl: Workload, vocab_size: int, special_ids: Iterable[int], salt: int) -> Workload:
    """`wl` with the same prompt lengths and other random tokens (a private RNG seeded with
    `salt`, 0 gives `wl` itself).

    The streaming benchmarks run several waves (1, 16, 64 streams) against one server; each
    wave gets its own prompts, so no wave finds an earlier one's prompts in a prefix cache
    (llama-server keeps each slot's last prompt, vLLM and asyncengine keep freed blocks).
    """
    if salt == 0:
        return wl
    allowed = _allowed_ids(vocab_size, special_ids)
    rng = random.Random(f"{SEED}-wave-{salt}")
    prompts = [[allowed[rng.randrange(len(allowed))] for _ in p] for p in wl.prompts]
    return Workload(prompts=prompts, output_len=wl.output_len)


def _allowed_ids(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """The ids a random prompt may use: every id below vocab_size but the special ones."""
    specials = set(special_ids)
    allowed = [t for t in range(vocab_size) if t not in specials]
    if not allowed:
        raise ValueError(f"no usable token ids in a vocabulary of {vocab_size}")
    return allowed


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation, as numpy's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@dataclass(slots=True)
class BenchResult:
    """One engine on one model: the seconds of each timed repeat, and start-up time."""

    engine: str
    model: str
    num_requests: int
    num_output_tokens: int
    generate_seconds: list[float]
    ready_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_seconds(self) -> float:
        return median(self.generate_seconds)

    @property
    def output_tok_per_s(self) -> float:
        """Output tokens per second of the median repeat."""
        return self.num_output_tokens / self.median_seconds

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["median_seconds"] = self.median_seconds
        record["output_tok_per_s"] = self.output_tok_per_s
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> BenchResult:
        names = {
            "engine", "model", "num_requests", "num_output_tokens",
            "generate_seconds", "ready_seconds", "extra",
        }  # fmt: skip
        return cls(**{k: v for k, v in record.items() if k in names})


def render_table(
    results: Sequence[BenchResult],
    baselines: Sequence[str] = (),
    extra_columns: Sequence[tuple[str, str]] = (),
) -> str:
    """A markdown table of results, with one `vs <baseline>` ratio column per baseline engine.

    A ratio is output tok/s over the baseline engine's on the same model; it is blank when that
    model has no result for the baseline. `extra_columns` are (header, key) pairs shown from
    each result's `extra` (blank when missing).
    """
    header = ["engine", "model", "output tok/s", *(f"vs {b}" for b in baselines), "ready s"]
    header += [title for title, _ in extra_columns]
    base_rate = {(r.engine, r.model): r.output_tok_per_s for r in results}
    rows = []
    for r in results:
        ratios = []
        for b in baselines:
            rate = base_rate.get((b, r.model))
            ratios.append(f"{r.output_tok_per_s / rate:.2f}x" if rate else "")
        extras = [_cell(r.extra.get(key)) for _, key in extra_columns]
        rows.append(
            [
                r.engine,
                r.model,
                f"{r.output_tok_per_s:.1f}",
                *ratios,
                f"{r.ready_seconds:.2f}",
                *extras,
            ]
        )
    numeric = len(header) - 2
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * numeric) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def match_fraction(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """The fraction of requests whose output token ids equal the reference's, in order."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    if not reference:
        return 1.0
    same = sum(list(a) == list(b) for a, b in zip(outputs, reference, strict=True))
    return same / len(reference)


def mean_common_prefix(
    outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
) -> float:
    """Mean, over requests, of how many leading output tokens equal the reference's.

    In bf16 two correct engines drift apart after a while (different batch shapes round
    differently and greedy decoding amplifies it), so this says more than exact equality.
    """
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    if not reference:
        return 0.0
    total = 0
    for a, b in zip(outputs, reference, strict=True):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        total += n
    return total / len(reference)


def model_vocab(model_dir: str | Path) -> tuple[int, set[int]]:
    """(vocab_size, special token ids) of a Hugging Face model folder, read from its JSON files.

    Special ids are the config's bos/eos/pad/unk ids plus every token that tokenizer.json marks
    special, so random prompts never contain a control token.
    """
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    specials: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(key)
        if isinstance(value, int):
            specials.add(value)
        elif isinstance(value, list):
            specials.update(v for v in value if isinstance(v, int))
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
        specials.update(int(t["id"]) for t in added if t.get("special"))
    return int(config["vocab_size"]), specials


def workload_for_model(model_dir: str | Path, wave: int = 0) -> Workload:
    """The benchmark workload over the vocabulary of the model in `model_dir`; a nonzero
    `wave` (the streaming runs pass their concurrency) gives the same lengths with tokens of
    that wave's own (`fresh_tokens`)."""
    vocab_size, specials = model_vocab(model_dir)
    return fresh_tokens(make_workload(vocab_size, specials), vocab_size, specials, wave)


def warmup_workload_for_model(model_dir: str | Path, num_requests: int = 4) -> Workload:
    """A few requests, shaped like the benchmark's but with other prompts (another seed), so a
    warm-up leaves nothing in a prefix cache that the timed run could reuse."""
    vocab_size, specials = model_vocab(model_dir)
    return make_workload(vocab_size, specials, num_requests=num_requests, seed=SEED + 1)
