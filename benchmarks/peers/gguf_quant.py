"""Quantized GGUF files of the benchmark models, made by llama.cpp's own tools, for the runs in
which asyncengine and llama.cpp serve the **same file** (`python -m benchmarks.peers --quant`).

A model folder goes to GGUF bf16 by llama.cpp's converter (`llamacpp.to_gguf`), then to each
quantization by `llama-quantize` (Q8_0; Q4_K_M, llama.cpp's usual mix of Q4_K and Q6_K
tensors), as a user's files are made. Files live under `.bench/gguf/<model>/`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.peers.llamacpp import LlamaCpp, to_gguf

# --quant's names, and llama-quantize's for them.
QUANTS: dict[str, str] = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}


def quant_label(quant: str) -> str:
    """How a quantization is named in reports: "Q8_0 GGUF"."""
    return f"{QUANTS[quant]} GGUF"


def parse_quants(value: str) -> list[str]:
    """--quant's comma-separated list; ValueError naming an unknown one and the known ones."""
    quants = [q.strip().lower() for q in value.split(",") if q.strip()]
    unknown = [q for q in quants if q not in QUANTS]
    if unknown:
        raise ValueError(f"--quant {', '.join(unknown)}: choose from {', '.join(QUANTS)}")
    return quants


def quantized_gguf(llama: LlamaCpp, model_dir: Path, out_dir: Path, quant: str) -> Path:
    """`model_dir` as `out_dir/model-QUANT.gguf`: converted to bf16, then quantized by
    llama-quantize, unless the file is there and newer than the bf16 one. The file appears
    whole or not at all. RuntimeError, with the tool's last output, when it fails."""
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    source = to_gguf(llama, model_dir, out_dir, "bf16")
    out = out_dir / f"model-{quant}.gguf"
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    fd, name = tempfile.mkstemp(dir=out_dir, prefix=f".{out.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    try:
        result = subprocess.run(
            [str(llama.quantize), str(source), str(partial), QUANTS[quant]],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-4000:]
            raise RuntimeError(f"llama-quantize {QUANTS[quant]} failed on {source}:\n{output}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out
