"""llama.cpp as a benchmark peer: built from source, fed GGUF files of the benchmark models.

- `ensure_built()`: llama.cpp from the `llama-cpp-python` sdist on PyPI (it vendors llama.cpp's
  source), built with cmake into `.bench/llamacpp/` (`-DGGML_NATIVE=ON`; targets llama-server,
  llama-batched-bench, llama-quantize; about 9 minutes on 2 cores), or what is there already.
- `fetch_source()`: the sdist alone (enough for the converter, no build).
- `to_gguf()`: a Hugging Face folder to GGUF (bf16, f32 or q8_0) by llama.cpp's own converter,
  run with the vendored `gguf-py` so converter and library match.
- `batched_bench()`: `llama-batched-bench`, output tokens over the wall time per batch size.
- `server_command()`: the `llama-server` command line for benchmarks/servers.py.

The converter needs numpy, sentencepiece and transformers (the `test` extra has them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / ".bench"
# Pinned: the converter's and the tools' flags are those of this release's llama.cpp.
SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-server", "llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI: no network here
)
OUTTYPES = ("bf16", "f32", "q8_0")


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """A llama.cpp source tree, and its build's tools (which may not exist yet)."""

    source: Path

    @property
    def bin(self) -> Path:
        return self.source / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin / "llama-server"

    @property
    def batched_bench(self) -> Path:
        return self.bin / "llama-batched-bench"

    @property
    def quantize(self) -> Path:
        return self.bin / "llama-quantize"

    @property
    def convert_script(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.source / "gguf-py"

    @property
    def built(self) -> bool:
        return all((self.bin / t).is_file() for t in TARGETS)


def fetch_source(bench_dir: Path = BENCH) -> LlamaCpp:
    """llama.cpp's source from the pinned sdist, downloaded and unpacked once into
    `bench_dir/llamacpp/`."""
    folder = bench_dir / "llamacpp"
    version = SDIST.split("==")[1]
    root = folder / f"llama_cpp_python-{version}"
    source = root / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return LlamaCpp(source)
    folder.mkdir(parents=True, exist_ok=True)
    tarball = folder / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
             "--no-deps", SDIST, "-d", str(folder)],
            check=True,
        )  # fmt: skip
    with tarfile.open(tarball) as tar:
        tar.extractall(folder, filter="data")
    return LlamaCpp(source)


def ensure_built(bench_dir: Path = BENCH, jobs: int | None = None) -> LlamaCpp:
    """The built tools, building them first where they are missing (minutes)."""
    llama = fetch_source(bench_dir)
    if llama.built:
        return llama
    build = llama.source / "build"
    print(f"building llama.cpp in {build} (several minutes) ...", file=sys.stderr, flush=True)
    subprocess.run(["cmake", "-S", str(llama.source), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run(
        ["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 1),
         "--target", *TARGETS],
        check=True,
    )  # fmt: skip
    return llama


def to_gguf(llama: LlamaCpp, model_dir: Path, out_dir: Path, outtype: str = "bf16") -> Path:
    """`model_dir` as `out_dir/model-OUTTYPE.gguf`, converted unless an up-to-date file is
    there (newer than the folder's config and weights)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    out = out_dir / f"model-{outtype}.gguf"
    inputs = [p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")]
    if out.is_file() and all(out.stat().st_mtime >= p.stat().st_mtime for p in inputs):
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": str(llama.gguf_py)}
    result = subprocess.run(
        [sys.executable, str(llama.convert_script), str(model_dir), "--outfile", str(partial),
         "--outtype", outtype],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed on {model_dir}:\n{result.stderr[-3000:]}")
    partial.replace(out)
    return out


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's results table, by column name (PP, TG, B, N_KV,
    T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s), as numbers."""
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if "PP" in cells and "B" in cells:
                header = cells
            continue
        if len(cells) == len(header) and all(re.fullmatch(r"[-+0-9.eE]+", c) for c in cells):
            rows.append(dict(zip(header, map(float, cells), strict=True)))
    return rows


def batched_bench(
    llama: LlamaCpp,
    gguf: Path,
    *,
    prompt_len: int = 80,
    gen_len: int = 64,
    batches: Sequence[int] = (1, 16, 64),
    threads: int = 2,
) -> dict[int, float]:
    """Output tokens per second of the whole batch (its prompt processing included) for each
    batch size B: B x gen_len over the table's T (seconds), each sequence with a prompt of its
    own (not shared)."""
    context = max(batches) * (prompt_len + gen_len) + 256
    result = subprocess.run(
        [str(llama.batched_bench), "-m", str(gguf), "-c", str(context), "-b", "2048",
         "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
         "-npl", ",".join(str(b) for b in batches), "-t", str(threads)],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed:\n{result.stderr[-3000:]}")
    rows = parse_batched_bench(result.stdout + "\n" + result.stderr)
    found = {int(r["B"]): int(r["B"]) * gen_len / r["T s"] for r in rows}
    missing = [b for b in batches if b not in found]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for B={missing}")
    return {b: found[b] for b in batches}


def server_command(
    llama: LlamaCpp,
    gguf: Path,
    port: int,
    *,
    parallel: int = 64,
    threads: int = 2,
    ctx_per_slot: int = 256,
) -> list[str]:
    """`llama-server` on 127.0.0.1:`port` with `parallel` slots of `ctx_per_slot` tokens each,
    continuous batching, `threads` threads, no web UI."""
    return [
        str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(parallel), "-t", str(threads), "-c", str(parallel * ctx_per_slot),
        "--cont-batching", "--no-webui",
    ]  # fmt: skip
