"""llama.cpp as a benchmark peer: built from source, fed GGUF files of the benchmark models.

- `ensure_built()`: llama.cpp from the pinned `llama-cpp-python` sdist on PyPI (it vendors
  llama.cpp's source), built with cmake into `.bench/llamacpp/` (`-DGGML_NATIVE=ON`; targets
  llama-server, llama-batched-bench, llama-quantize, llama-perplexity, llama-tokenize; about
  10 minutes on 2 cores), or what is there already.
- `fetch_source()`: the sdist alone, unpacked (enough for the converter, no build).
- `to_gguf()`: a Hugging Face folder to GGUF (bf16, f32 or q8_0) by llama.cpp's own converter,
  run with the vendored `gguf-py`, so converter and library match.
- `batched_bench()`: `llama-batched-bench`, output tokens over the wall time per batch size;
  `parse_batched_bench()` reads its table.
- `server_command()`: the `llama-server` command line for servers.py.

The converter imports torch, numpy, transformers, PyYAML (the vendored gguf-py) and, for Llama
models, sentencepiece. sentencepiece goes into a folder of its own (`.bench/llamacpp/pydeps`,
on the converter's PYTHONPATH only), not into the environment: loaded beside torch in a test
process it crashed that process at exit (a segfault in its static destructors, after every
test had passed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / ".bench"
# Pinned: the flags used below, and the converter's behaviour, are those of this release's
# vendored llama.cpp.
SDIST_VERSION = "0.3.36"
TARGETS = (
    "llama-server", "llama-batched-bench", "llama-quantize", "llama-perplexity", "llama-tokenize"
)  # fmt: skip
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON downloads the web UI at configure time
)
OUTTYPES = ("bf16", "f32", "q8_0")


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """A llama.cpp source tree and the paths of its tools (which exist once it is built)."""

    source: Path  # the llama.cpp root: .../llama_cpp_python-VERSION/vendor/llama.cpp

    @property
    def bin_dir(self) -> Path:
        return self.source / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def batched_bench(self) -> Path:
        return self.bin_dir / "llama-batched-bench"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def perplexity(self) -> Path:
        return self.bin_dir / "llama-perplexity"

    @property
    def tokenize(self) -> Path:
        return self.bin_dir / "llama-tokenize"

    @property
    def convert_script(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        """The vendored `gguf` package's folder, for PYTHONPATH: the converter needs the
        release it was written with, not whichever `gguf` PyPI gave the environment."""
        return self.source / "gguf-py"

    @property
    def built(self) -> bool:
        return all((self.bin_dir / t).is_file() for t in TARGETS)


def fetch_source(bench_dir: Path = BENCH_DIR) -> LlamaCpp:
    """llama.cpp's source from the pinned sdist, downloaded and unpacked once into
    `bench_dir/llamacpp/` (tens of MB; needs PyPI)."""
    folder = bench_dir / "llamacpp"
    llama = LlamaCpp(folder / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp")
    if _unpacked(llama):
        return llama
    with _locked(folder):
        if not _unpacked(llama):  # another process may have unpacked it while we waited
            _unpack(_download(folder), folder)
    return llama


def ensure_built(bench_dir: Path = BENCH_DIR, jobs: int | None = None) -> LlamaCpp:
    """llama.cpp with its tools built, building them first where they are missing (minutes,
    with `jobs` compilers, default one per CPU). Concurrent callers wait for one build."""
    llama = fetch_source(bench_dir)
    if llama.built:
        return llama
    with _locked(bench_dir / "llamacpp"):
        if not llama.built:
            _build(llama, jobs or os.cpu_count() or 1)
    return llama


def _unpacked(llama: LlamaCpp) -> bool:
    return (llama.source / "CMakeLists.txt").is_file() and llama.convert_script.is_file()


def _download(folder: Path) -> Path:
    tarball = folder / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if tarball.is_file():
        return tarball
    # Into a scratch folder first: an interrupted download must not pass for the sdist.
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
             "--no-deps", f"llama-cpp-python=={SDIST_VERSION}", "-d", scratch],
            check=True,
        )  # fmt: skip
        os.replace(Path(scratch) / tarball.name, tarball)
    return tarball


def _unpack(tarball: Path, folder: Path) -> None:
    root = folder / f"llama_cpp_python-{SDIST_VERSION}"
    shutil.rmtree(root, ignore_errors=True)  # what an interrupted unpack left
    with tempfile.TemporaryDirectory(dir=folder) as scratch, tarfile.open(tarball) as tar:
        tar.extractall(scratch, filter="data")
        os.replace(Path(scratch) / root.name, root)


def _build(llama: LlamaCpp, jobs: int) -> None:
    build = llama.source / "build"
    print(f"building llama.cpp in {build} (minutes) ...", file=sys.stderr, flush=True)
    subprocess.run(["cmake", "-S", str(llama.source), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run(
        ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS], check=True
    )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` between processes (pytest workers, nox sessions), so that
    one downloads and builds while the others wait."""
    import fcntl  # POSIX only, as is building llama.cpp here

    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Run with `python -c` ahead of the converter: argv is [-c, MODEL_TYPE, SCRIPT, ARGS...].
# transformers 5 loads the tokenizer of some model types (qwen2 among them) with the class
# registered for the type, whatever tokenizer_config.json names, and that class rebuilds the
# pre-tokenizer: a qwen2 folder with SmolLM2's tokenizer.json (benchmark model d) then
# tokenizes unlike its tokenizer.json, and the converter, which fingerprints the tokenizer to
# name llama.cpp's pre-tokenizer, refuses it. MODEL_TYPE (or "") is a type whose folder asks
# for its tokenizer.json as is; the override is lifted for it alone.
_CONVERTER_BOOTSTRAP = """\
import os, runpy, sys
model_type, script = sys.argv[1], sys.argv[2]
if model_type:
    from transformers.models.auto import tokenization_auto
    forced = getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", None)
    if isinstance(forced, set):
        forced.discard(model_type)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` would
runpy.run_path(script, run_name="__main__")
"""
# tokenizer_config.json's classes that mean "tokenizer.json, as it is".
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def to_gguf(llama: LlamaCpp, model_dir: Path, out_dir: Path, outtype: str = "bf16") -> Path:
    """`model_dir` (a Hugging Face model folder) as `out_dir/model-OUTTYPE.gguf`, converted by
    llama.cpp's converter unless that file is there already and newer than every file of the
    folder. The file appears whole or not at all. Raises RuntimeError, with the converter's
    last output, when it fails."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    out = out_dir / f"model-{outtype}.gguf"
    if _up_to_date(out, model_dir):
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out_dir, prefix=f".{out.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    pythonpath = [
        str(llama.gguf_py),
        str(_converter_deps(llama)),
        *filter(None, [os.environ.get("PYTHONPATH")]),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "HF_HUB_OFFLINE": "1",  # a local folder: nothing to fetch
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", _CONVERTER_BOOTSTRAP, _tokenizer_as_shipped(model_dir),
             str(llama.convert_script), str(model_dir), "--outfile", str(partial),
             "--outtype", outtype],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(
                f"convert_hf_to_gguf.py failed on {model_dir}:\n{result.stderr[-4000:]}"
            )
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


CONVERTER_DEPS = ("sentencepiece==0.2.1",)


def _converter_deps(llama: LlamaCpp) -> Path:
    """A folder holding what the converter imports beyond this environment (installed once)."""
    folder = llama.source.parent.parent.parent / "pydeps"
    marker = folder / ".installed"
    if marker.is_file() and marker.read_text() == " ".join(CONVERTER_DEPS):
        return folder
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
         "--target", str(folder), *CONVERTER_DEPS],
        check=True,
    )  # fmt: skip
    marker.write_text(" ".join(CONVERTER_DEPS))
    return folder


def _up_to_date(out: Path, model_dir: Path) -> bool:
    if not out.is_file():
        return False
    made = out.stat().st_mtime
    return all(p.stat().st_mtime <= made for p in model_dir.iterdir() if p.is_file())


def _tokenizer_as_shipped(model_dir: Path) -> str:
    """The folder's model type when its tokenizer_config.json asks for tokenizer.json as it
    is (see _CONVERTER_BOOTSTRAP), else ""."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    if tokenizer_config.get("tokenizer_class") not in _GENERIC_TOKENIZER_CLASSES:
        return ""
    if not (model_dir / "tokenizer.json").is_file():
        return ""
    return str(config.get("model_type") or "")


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's results table (its default, markdown output), keyed
    by column name (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s), as
    numbers. Other lines are ignored; no table gives []."""
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue  # not a table line, or the rule under the header
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if {"PP", "TG", "B", "T s"} <= set(cells):
                header = cells
            continue
        if len(cells) == len(header) and all(_NUMBER.fullmatch(c) for c in cells):
            rows.append(dict(zip(header, map(float, cells), strict=True)))
    return rows


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)")


def batched_bench(
    llama: LlamaCpp,
    gguf: Path,
    *,
    prompt_len: int = 80,
    gen_len: int = 64,
    batches: Sequence[int] = (1, 16, 64),
    threads: int = 2,
    context_batch: int | None = None,
) -> dict[int, float]:
    """For each batch size B: B x gen_len output tokens over the seconds llama-batched-bench
    took for the whole batch (its prompts' prefill included), each of the B sequences with a
    prompt of its own. The KV context holds `context_batch` sequences (default: the largest
    of `batches`), so that a run of one batch size alone sizes it as a run of all would.
    Raises RuntimeError when the tool fails or skips a batch size."""
    # Enough KV cells for the largest batch; llama.cpp gives each sequence an equal share.
    context = (context_batch or max(batches)) * (prompt_len + gen_len)
    result = subprocess.run(
        [str(llama.batched_bench), "-m", str(gguf), "-c", str(context), "-b", "2048",
         "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
         "-npl", ",".join(map(str, batches)), "-t", str(threads)],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed:\n{result.stderr[-4000:]}")
    # The table is on stdout in this release; stderr too, in case a release moves it.
    rows = parse_batched_bench(result.stdout + "\n" + result.stderr)
    found = {int(r["B"]): int(r["B"]) * gen_len / r["T s"] for r in rows}
    missing = [b for b in batches if b not in found]
    if missing:  # it skips, silently, a batch that does not fit the context
        raise RuntimeError(f"llama-batched-bench printed no row for B={missing}")
    return {b: found[b] for b in batches}


# KV cells per llama-server slot (the harness gives asyncengine's server as many in all).
SERVER_CTX_PER_SLOT = 256


def server_command(
    llama: LlamaCpp,
    gguf: Path,
    port: int,
    *,
    parallel: int = 64,
    threads: int = 2,
    ctx_per_slot: int = SERVER_CTX_PER_SLOT,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`llama-server` on 127.0.0.1:`port`: `parallel` slots of `ctx_per_slot` tokens each
    (llama.cpp rounds a slot up to a multiple of 256), continuous batching, `threads` threads,
    no web UI and no network access of its own."""
    return [
        str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(parallel), "-t", str(threads), "-c", str(parallel * ctx_per_slot),
        "--cont-batching", "--no-ui", "--offline", *extra_args,
    ]  # fmt: skip
