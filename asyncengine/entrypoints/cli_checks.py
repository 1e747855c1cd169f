"""Checks the command line makes before an engine loads, so that a mistake is one line naming
the option or the file, not a traceback from deep inside the load seconds later.

Each raises ValueError with that line; none imports torch (the checks of `serve` run in the
front-end process, which never does).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import struct
from pathlib import Path

# The safetensors format: an 8-byte little-endian header length, a JSON header, the tensors.
_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def check_device(device: str | None) -> None:
    """`--device cuda` where this torch cannot run CUDA (a CPU-only build, or every GPU
    hidden): a ValueError saying so. `auto` picks what is there, and CUDA failures this
    cannot see (a driver too old, say) surface when the engine starts."""
    if device != "cuda":
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden in ("", "-1"):
        raise ValueError(
            f"--device cuda: CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU; unset it, "
            "or use --device cpu"
        )
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return  # no torch at all: the engine's start-up says that itself
    # A CUDA build of torch ships its CUDA library next to the others (as config.py checks).
    if not any((Path(spec.origin).parent / "lib").glob("libtorch_cuda*")):
        raise ValueError(
            f"--device cuda: the installed {_torch_version()} is built without CUDA; "
            "install a CUDA build of torch, or use --device cpu"
        )


def _torch_version() -> str:
    try:
        return f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        return "torch"


def check_checkpoint(model: str | os.PathLike[str]) -> None:
    """Every `*.safetensors` file of the model folder `model` is whole: its header reads and
    its tensors end where the file does. A ValueError naming the first that is not (cut short
    by a download or a copy, say). Reads the headers only; a model that is not a folder is left
    to the engine's own checks."""
    folder = Path(model)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            raise ValueError(f"{path}: {problem}; copy or download it again")


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file at `path`, or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(_HEADER_LENGTH.size)
            if len(prefix) < _HEADER_LENGTH.size:
                return f"truncated: {size} bytes, too few for a safetensors header"
            (header_bytes,) = _HEADER_LENGTH.unpack(prefix)
            if header_bytes > min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH.size):
                return (
                    f"truncated or not a safetensors file: its header length ({header_bytes} "
                    f"bytes) does not fit in the file ({size} bytes)"
                )
            header = json.loads(f.read(header_bytes))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # JSON (UnicodeDecodeError is one too)
        return f"damaged: its header is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return "damaged: its header is not a JSON object"
    try:
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
            default=0,
        )
    except (TypeError, KeyError, IndexError, ValueError):
        return "damaged: its header does not describe tensors"
    expected = _HEADER_LENGTH.size + header_bytes + end
    if expected > size:
        return f"truncated: its tensors need {expected} bytes, the file holds {size}"
    if expected < size:
        return f"damaged: {size - expected} bytes follow its last tensor"
    return None
