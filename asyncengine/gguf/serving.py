"""A GGUF file as the engine's model: finding it, checking that this version runs it, and
its tokenizer folder, for the client side (standard library only: no torch, no transformers).

`resolve_gguf(path)` is what `resolve_model` calls for a `.gguf` file or a folder holding
exactly one (and no safetensors): it reads the file's header, refuses tensor types this
version does not run yet, and builds the tokenizer folder once, under the engine's cache
(`paths.cache_dir()`), in a child process (building it imports transformers, ~1.5 s, which
the caller's process must not). The engine then names the file itself as its model
(`ModelConfig.model`): the worker reads the weights from it (`model/gguf_checkpoint.py`), the
client's tokenizer and the grammar compiler from `tokenizer_folder(model)`.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncengine.gguf.errors import GGUFError
from asyncengine.gguf.ggml_types import GGMLType
from asyncengine.gguf.model import GGUFModel, read_gguf
from asyncengine.gguf.tokenizer import is_complete, tokenizer_dir, tokenizer_target
from asyncengine.paths import cache_dir

GGUF_SUFFIX = ".gguf"
_TOKENIZER_SUBDIR = "gguf-tokenizers"


def is_gguf_file(model: str | os.PathLike[str]) -> bool:
    """Whether `model` (a `ModelConfig.model`) names a GGUF file rather than a folder."""
    path = Path(model)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself (a `.gguf` file), or the one `.gguf` in a folder
    that holds no safetensors and no config.json; None for anything else (a model folder).
    A folder of several GGUF files and nothing else is a ValueError asking which one."""
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    if any(path.glob("*.safetensors")):
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
        raise ValueError(
            f"model={str(path)!r} holds {len(files)} GGUF files ({names}): name one of them"
        )
    return files[0] if files else None


def check_runnable(model: GGUFModel) -> None:
    """Raise `GGUFError` naming what in the file the lean forward cannot apply: a
    `rope_freqs` tensor (Llama 3.1-style rope scaling) of another type than F32 / F16 or size
    than one value per rotary frequency. (A tensor of a type the engine does not run is
    refused when the file is read.)"""
    freqs = model.extra_tensors.get("rope_freqs.weight")
    if freqs is not None:  # Llama 3.1-style rope scaling: a divisor per rotary frequency
        hf = model.hf_config
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        count = 1
        for dim in freqs.shape:
            count *= dim
        if freqs.ggml_type not in (GGMLType.F32, GGMLType.F16) or count != head_dim // 2:
            raise GGUFError(
                model.path,
                f"rope_freqs.weight is {freqs.ggml_type.name} of shape {list(freqs.shape)}: "
                f"expected {head_dim // 2} F32 or F16 values (one per rotary frequency of the "
                f"{head_dim}-wide heads)",
            )


def resolve_gguf(path: Path) -> Path:
    """Check the GGUF file `path` for serving and make sure its tokenizer folder exists
    (built in a child process the first time); returns the file's path. `GGUFError`
    (a ValueError naming the file) for a file this version cannot serve."""
    model = read_gguf(path)
    try:
        check_runnable(model)
        target = _tokenizer_target(model.path)
    finally:
        model.close()
    if not is_complete(target):
        _build_tokenizer_in_child(model.path)
    return model.path


@functools.lru_cache(maxsize=8)
def _hf_config(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    model = read_gguf(path)
    try:
        return model.hf_config
    finally:
        model.close()


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The config.json dict of the GGUF file `path` (from its metadata)."""
    st = path.stat()
    return dict(_hf_config(str(path.resolve()), st.st_size, st.st_mtime_ns))


def tokenizer_folder(model: str | os.PathLike[str]) -> Path:
    """The folder holding the tokenizer of `model` (a `ModelConfig.model`): the model folder
    itself, or for a GGUF file the folder `resolve_gguf` built (ValueError if it has not)."""
    if not is_gguf_file(model):
        return Path(model)
    target = _tokenizer_target(Path(model))
    if not is_complete(target):
        raise ValueError(
            f"{model}: its tokenizer folder {target} has not been built; load the file "
            "through LLM / AsyncLLM.from_pretrained (EngineConfig.from_kwargs), which builds it"
        )
    return target


def served_model_name(model: str | os.PathLike[str]) -> str:
    """The name a server announces for a `model` argument: a GGUF file's stem (also for a
    folder holding just that file), else the folder's name (or the argument itself)."""
    path = Path(model).expanduser()
    try:
        gguf_file = find_gguf(path)
    except ValueError:
        gguf_file = None
    if gguf_file is not None:
        return gguf_file.stem
    if path.suffix.lower() == GGUF_SUFFIX:
        return path.stem
    return path.name or os.fspath(model)


def _tokenizer_target(path: Path) -> Path:
    return tokenizer_target(path, cache_dir() / _TOKENIZER_SUBDIR)


def build_tokenizer(path: str) -> Path:
    """Build (or find) the tokenizer folder of the GGUF file `path`, in this process."""
    model = read_gguf(path)
    try:
        return tokenizer_dir(model.path, model.metadata, cache_dir() / _TOKENIZER_SUBDIR)
    finally:
        model.close()


def _build_tokenizer_in_child(path: Path) -> None:
    code = (
        "import sys; from asyncengine.gguf.serving import build_tokenizer; "
        "build_tokenizer(sys.argv[1])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)], check=False, capture_output=True, text=True
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise GGUFError(
            path,
            "building its tokenizer failed: " + (lines[-1] if lines else f"exit {proc.returncode}"),
        )
