"""The perplexity harness (benchmarks/perplexity.py) without llama.cpp: llama-perplexity's
chunking and scoring window on small token lists, the perplexity arithmetic, the parsing of
llama-perplexity's and llama-tokenize's output (captured from the pinned release), and one run
of asyncengine on a tiny random GGUF file against transformers in fp32 over the same weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# benchmarks/ sits beside the package at the repository root, which is not on sys.path; the
# tiny GGUF writer lives beside the GGUF tests.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "model"))

from benchmarks import perplexity as ppl  # noqa: E402
from benchmarks.peers import llamacpp  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# llama-perplexity's output (stdout, then stderr, as the harness joins them) from the pinned
# release: SmolLM2-135M-Instruct Q8_0 (made by llama-quantize from the Q4_1 file) on
# benchmarks/data/stdlib_docstrings.txt, -c 512 -t 2 --no-escape; long lines split, trailing
# spaces dropped.
SAMPLE = """\
1.93 minutes
[1]8.5542,[2]8.0820,[3]9.1003,[4]8.9743,[5]9.3094,[6]11.0291,[7]9.6782,[8]10.2147,[9]10.10\
50,[10]9.9502,[11]10.2524,[12]10.1027,[13]9.9546,[14]9.9545,[15]9.1038,[16]9.5165,[17]9.91\
46,[18]10.4158,[19]10.5286,[20]9.8639,[21]9.5998,


0.00.426.343 I cmn          init: llama threadpool init, n_threads = 2
0.05.177.875 I
0.05.178.021 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSS\
E3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1\
 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |
0.05.178.041 I perplexity: tokenizing the input ..
0.05.204.295 I perplexity: tokenization took 26.246 ms
0.05.204.340 I perplexity: calculating perplexity over 21 chunks, n_ctx=512, batch_size=20\
48, n_seq=4
0.27.470.802 I perplexity: 22.27 seconds per pass - ETA 1.43.733.063 I Final estimate: PPL\
 = 9.5998 +/- 0.35397
"""


def test_chunks_are_whole_windows_of_n_ctx_the_rest_dropped() -> None:
    tokens = list(range(11))
    assert ppl.make_chunks(tokens, 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # where the vocabulary adds BOS, every chunk starts with it (replacing a text token)
    assert ppl.make_chunks(tokens, 4, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert ppl.make_chunks(list(range(12)), 4, None)[-1] == [8, 9, 10, 11]
    assert tokens == list(range(11))  # the input is left as it was
    with pytest.raises(ValueError, match="needs 8 or more"):
        ppl.make_chunks(list(range(7)), 4, None)
    with pytest.raises(ValueError, match="even"):
        ppl.make_chunks(list(range(20)), 5, None)


def test_only_the_second_half_of_a_chunk_is_scored() -> None:
    """llama-perplexity scores the logits at n_ctx/2 .. n_ctx-2, i.e. the tokens at
    n_ctx/2+1 .. n_ctx-1: n_ctx - n_ctx/2 - 1 tokens a chunk (255 of 512)."""
    assert ppl.scored_positions(8) == range(5, 8)
    assert len(ppl.scored_positions(512)) == 255
    logprobs: list[float | None] = [None, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    assert ppl.chunk_nlls(logprobs, 8) == [5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="positions"):
        ppl.chunk_nlls(logprobs[:-1], 8)
    with pytest.raises(ValueError, match="position 5"):
        ppl.chunk_nlls([*logprobs[:5], None, -6.0, -7.0], 8)


def test_perplexity_is_exp_of_the_mean_nll() -> None:
    assert ppl.perplexity([math.log(4.0)] * 3) == pytest.approx(4.0)
    assert ppl.perplexity([0.5, 1.5, 2.5]) == pytest.approx(math.exp(1.5))
    assert ppl.perplexity(iter([0.0])) == 1.0
    with pytest.raises(ValueError, match="no scored tokens"):
        ppl.perplexity([])


def test_llama_perplexity_output_parses() -> None:
    final, running, chunks = ppl.parse_llama_perplexity(SAMPLE)
    assert final == 9.5998 and chunks == 21
    assert len(running) == 21 and running[0] == 8.5542 and running[-1] == final
    with pytest.raises(ValueError, match="Final estimate"):
        ppl.parse_llama_perplexity("[1]8.5542,[2]8.0820,")


def test_llama_tokenize_ids_parse() -> None:
    assert ppl.parse_token_ids("some log line\n[1, 22, 333]\n") == [1, 22, 333]
    assert ppl.parse_token_ids("[]\n") == []
    with pytest.raises(ValueError, match="no token id list"):
        ppl.parse_token_ids("nothing\n")


def test_the_text_is_read_as_llama_perplexity_reads_it(tmp_path: Path) -> None:
    """`-f` drops one trailing newline; with --no-escape the rest is as it is."""
    f = tmp_path / "t.txt"
    f.write_text("a\\nb\n\n")
    assert ppl.read_text(f) == "a\\nb\n"
    f.write_text("abc")
    assert ppl.read_text(f) == "abc"


def test_the_shipped_text() -> None:
    text = ppl.TEXT.read_text(encoding="utf-8")
    assert 30_000 < len(text) < 50_000 and text.startswith("textwrap\n")
    if sys.version_info[:3] == (3, 11, 7):  # the version that wrote it
        assert ppl.gather_docstrings() == text


def test_first_divergence() -> None:
    assert ppl.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert ppl.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert ppl.first_divergence([1, 2], [1, 2, 3]) == 2
    prompts = ppl.greedy_prompts(list(range(100)), 3, length=10)
    assert [p[0] for p in prompts] == [0, 30, 60] and all(len(p) == 10 for p in prompts)


def test_llama_cpp_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tools' command lines: the text as it is (no escapes), llama-tokenize without special
    tokens parsed; the outputs parsed."""
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        if cmd[0].endswith("llama-tokenize"):
            return subprocess.CompletedProcess(cmd, 0, stdout="[5, 6, 7]\n", stderr="")
        stdout, _, stderr = SAMPLE.partition("\n\n")
        return subprocess.CompletedProcess(cmd, 0, stdout=stdout, stderr=stderr)

    monkeypatch.setattr(subprocess, "run", fake_run)
    llama = llamacpp.LlamaCpp(source=tmp_path)
    model, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    assert ppl.llamacpp_tokens(llama, model, text) == [5, 6, 7]
    assert commands[-1][0] == str(llama.tokenize)
    assert {"--ids", "--no-escape", "--no-parse-special"} <= set(commands[-1])
    result = ppl.llamacpp_perplexity(llama, model, text, 512, threads=2)
    assert result.perplexity == 9.5998 and result.n_chunks == 21
    cmd = commands[-1]
    assert cmd[0] == str(llama.perplexity) and "--no-escape" in cmd
    assert cmd[cmd.index("-c") + 1] == "512" and cmd[cmd.index("-f") + 1] == str(text)


def _logits_file(logits: np.ndarray, tokens: list[int], n_ctx: int) -> bytes:
    """llama-perplexity's --kl-divergence-base file for these logits ([chunks, scored, V]),
    written as perplexity.cpp writes it (its log_softmax and nearest_int, in numpy)."""
    n_chunk, n_scored, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    out = [b"_logits_", np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes()]
    out.append(np.asarray(tokens, np.int32).tobytes())
    for c in range(n_chunk):
        for i in range(n_scored):
            row = logits[c, i].astype(np.float32)
            top, low = row.max(), max(row.min(), row.max() - 16)
            lse = np.float32(np.log(np.exp((row - top).astype(np.float64)).sum()))
            scale = np.float32((top - low) / 65535)
            q = np.where(row > low, np.rint((row - low) / scale), 0).astype(np.uint16)
            head = np.array([scale, low - top - lse], np.float32).view(np.uint16)
            pad = np.zeros(nv - 4 - n_vocab, np.uint16)
            out.append(np.concatenate([head, q, pad]).tobytes())
    return b"".join(out)


def test_llama_perplexity_logits_file_reads_back_to_nlls() -> None:
    """The per-token NLLs read back from the logits file are the logits' own (to the file's
    16-bit rounding), the window that of the method."""
    rng = np.random.default_rng(1)
    n_ctx, vocab = 8, 11  # odd: rows padded
    tokens = rng.integers(0, vocab, size=2 * n_ctx).tolist()
    logits = rng.standard_normal((2, 3, vocab)).astype(np.float32) * 3
    got_ctx, got_tokens, nlls = ppl.parse_logits_file(_logits_file(logits, tokens, n_ctx))
    assert got_ctx == n_ctx and got_tokens == tokens
    logprobs = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    for c in range(2):
        targets = tokens[c * n_ctx + 5 : (c + 1) * n_ctx]  # positions 5, 6, 7 of the chunk
        expected = [-float(logprobs[c, i, t]) for i, t in enumerate(targets)]
        assert nlls[c] == pytest.approx(expected, abs=1e-3)
    with pytest.raises(ValueError, match="magic"):
        ppl.parse_logits_file(b"nothing")
    diff = ppl.compare_nlls([1.0, 2.0, 3.5], [1.0, 2.5, 3.0])
    assert diff["max_abs_diff"] == 0.5 and diff["max_at_scored_index"] == 1
    assert diff["mean_diff"] == 0.0 and diff["mean_abs_diff"] == pytest.approx(1 / 3)


def test_requantize_writes_the_file_whole_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        Path(cmd[3]).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    llama = llamacpp.LlamaCpp(source=tmp_path)
    out = ppl.requantize(llama, source, tmp_path / "out", "Q4_K_M")
    assert out == tmp_path / "out" / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    assert calls[0][1] == "--allow-requantize" and calls[0][-1] == "Q4_K_M"
    assert ppl.requantize(llama, source, tmp_path / "out", "Q4_K_M") == out
    assert len(calls) == 1  # made once
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no partial file left


def _reference_perplexity(path: Path, tiny: Any, chunks: list[list[int]]) -> float:
    """transformers' perplexity in fp32 over the file's weights (dequantized, HF row order),
    by llama-perplexity's method."""
    import transformers
    from test_gguf_files import expected_values  # type: ignore[import-not-found]

    from asyncengine.gguf import read_gguf

    model_file = read_gguf(path)
    hf = dict(model_file.hf_config)
    model_file.close()
    hf.pop("architectures")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model: Any = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.float().eval()
    state = {name: torch.from_numpy(expected_values(tiny, name)) for name in tiny.weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    n_ctx = len(chunks[0])
    nlls: list[float] = []
    with torch.inference_mode():
        for chunk in chunks:
            logits = model(torch.tensor([chunk])).logits[0].float()  # [n_ctx, V]
            logprobs = torch.log_softmax(logits, dim=-1)
            for p in ppl.scored_positions(n_ctx):
                nlls.append(-float(logprobs[p - 1, chunk[p]]))
    return ppl.perplexity(nlls)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("gguf")
    from test_gguf_files import Q, write_tiny_gguf  # type: ignore[import-not-found]

    path = tmp_path_factory.mktemp("ppl") / "tiny.gguf"
    return path, write_tiny_gguf(path, "llama", weight_type=Q.F32, seed=7)


def test_our_perplexity_equals_transformers_fp32(tiny_gguf: tuple[Path, Any]) -> None:
    """asyncengine's perplexity of a tiny random fp32 GGUF model, from prompt_logprobs, equals
    transformers' over the same weights (fp32 logits, same chunks, same window)."""
    path, tiny = tiny_gguf
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tiny.vocab_size - 3, size=3 * 32 + 5).tolist()
    chunks = ppl.make_chunks(tokens, 32, None)
    assert len(chunks) == 3
    ours = ppl.asyncengine_perplexity(path, chunks, dtype="float32", threads=1)
    assert [len(c) for c in ours.nlls] == [15, 15, 15]
    assert ours.perplexity == pytest.approx(_reference_perplexity(path, tiny, chunks), rel=1e-4)


def test_the_command_line_without_llama_cpp(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    """`--model FILE --ctx N --json OUT` on a small text: the row's perplexity is that of the
    file's tokenization of the text, chunked and scored as llama-perplexity does."""
    path, tiny = tiny_gguf
    text = tmp_path / "text.txt"
    text.write_text("Hello world, the docstrings of the world say hello.\n" * 4)
    out = tmp_path / "out.json"
    assert ppl.main(["--model", str(path), "--text", str(text), "--ctx", "32",
                     "--threads", "1", "--json", str(out)]) == 0  # fmt: skip
    [row] = json.loads(out.read_text())
    tokens, bos = ppl.asyncengine_tokens(path, ppl.read_text(text))
    assert bos is None  # the tiny vocabulary adds no BOS
    chunks = ppl.make_chunks(tokens, 32, bos)
    assert row["n_tokens"] == len(tokens) and row["n_chunks"] == len(chunks)
    assert row["scored_tokens"] == 15 * len(chunks) and row["llamacpp_ppl"] is None
    expected = _reference_perplexity(path, tiny, chunks)
    assert row["asyncengine_ppl"] == pytest.approx(expected, rel=1e-4)
