"""The tokenizer and chat template of a GGUF file, as a tokenizer folder the engine reads.

A GGUF file stores its vocabulary, merges, token types and special token ids as
`tokenizer.ggml.*` metadata and the chat template as `tokenizer.chat_template`. transformers
turns those into a fast tokenizer (`convert_gguf_tokenizer`, the code behind
`from_pretrained(..., gguf_file=...)`); we hand it the metadata this package already parsed, so
neither torch nor the `gguf` package is imported, and save the result as tokenizer.json and
tokenizer_config.json (special tokens, add_bos_token, the chat template) in a cache folder keyed
by the file's identity, where `asyncengine.client.tokenizer.Tokenizer` loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asyncengine.gguf.errors import GGUFError

# tokenizer.ggml.model values transformers builds a tokenizer for (byte-level BPE, as in
# Llama 3, Qwen and SmolLM; SentencePiece BPE, as in Llama 2 and Mistral).
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
_MARKER = ".asyncengine-tokenizer"  # written last: its presence means the folder is complete
_FORMAT = 2  # bump to rebuild cached folders after a change in what is written
# tokenizer.ggml.pre values for which llama.cpp splits every digit off on its own before the
# byte-level regex ("\\p{N}" first); transformers' converter writes plain ByteLevel for them.
DIGIT_SPLIT_PRE = ("smollm",)

# tokenizer.<key> → the key transformers' converter reads (GGUF_TOKENIZER_MAPPING).
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def check_tokenizer(path: str | os.PathLike[str], metadata: dict[str, Any]) -> None:
    """Raise `GGUFError` unless the file carries a tokenizer we can build."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model is None or not isinstance(tokens, list) or not tokens:
        raise GGUFError(
            path,
            "the file carries no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens "
            "metadata); asyncengine serves a GGUF file only with its own tokenizer",
        )
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFError(
            path,
            f"tokenizer.ggml.model {model!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)}",
        )
    for key in ("scores", "token_type"):
        values = metadata.get(f"tokenizer.ggml.{key}")
        if values is not None and len(values) != len(tokens):
            raise GGUFError(
                path, f"tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens"
            )
    for key in _SPECIAL_TOKENS.values():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFError(path, f"tokenizer.ggml.{key} {token_id} is not a token id")


def tokenizer_dir(
    path: str | os.PathLike[str], metadata: dict[str, Any], cache: str | os.PathLike[str]
) -> Path:
    """A folder under `cache` with the file's tokenizer.json and tokenizer_config.json (and
    its chat template), written on first use; later calls, in any process, return it at once.

    The folder is named after the file's stem and identity (resolved path, size, mtime), so a
    changed file gets a new one. Raises `GGUFError` if the file carries no usable tokenizer."""
    path = Path(path)
    check_tokenizer(path, metadata)
    target = tokenizer_target(path, cache)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_tokenizer(metadata, tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(path.resolve())}) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private; a shared cache must be readable
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _MARKER).is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tokenizer_target(path: str | os.PathLike[str], cache: str | os.PathLike[str]) -> Path:
    """Where `tokenizer_dir` keeps the tokenizer folder of the file `path` under `cache`."""
    path = Path(path)
    return Path(cache) / f"{path.stem}-tokenizer-{_identity(path)}"


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a tokenizer folder `tokenizer_dir` finished writing."""
    return (folder / _MARKER).is_file()


def _identity(path: Path) -> str:
    st = path.stat()
    key = f"{_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def converter_inputs(metadata: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) as transformers' `get_gguf_tokenizer` makes them."""
    tokenizer = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in _TOKENIZER_KEYS.items()
        if f"tokenizer.{key}" in metadata
    }
    config: dict[str, Any] = {}
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in metadata:
            config[key] = bool(metadata[f"tokenizer.ggml.{key}"])
    if tokenizer.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        config.setdefault("add_bos_token", True)
    tokens = tokenizer["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    return tokenizer, config


# Architectures whose tokenizer converter some transformers versions lack, and the one that
# reads the same vocabulary.
_CONVERTER_FALLBACK = {"mistral": "llama", "qwen3": "qwen2"}


def _write_tokenizer(metadata: dict[str, Any], out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    try:  # transformers 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            convert_gguf_tokenizer,
        )

    tokenizer_dict, config = converter_inputs(metadata)
    arch = str(metadata["general.architecture"])
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except KeyError:
        # Older transformers (before 5.2x) have no "mistral" entry: Mistral's GGUF vocabulary
        # is Llama's (SentencePiece, or byte-level BPE for Tekken, which the Llama converter
        # reads from tokenizer.ggml.model).
        if arch not in _CONVERTER_FALLBACK:
            raise
        backend, extra = convert_gguf_tokenizer(_CONVERTER_FALLBACK[arch], tokenizer_dict)
    # The file's own special tokens win over the converter's guesses (some transformers
    # versions swap BOS and EOS in theirs, and pass both, which a keyword clash refuses).
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, **{**extra, **config}
    )
    context = metadata.get(f"{arch}.context_length")
    if isinstance(context, int):
        tokenizer.model_max_length = context
    tokenizer.save_pretrained(str(out))
    if metadata.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        split_digits_first(out / "tokenizer.json")


def split_digits_first(tokenizer_json: Path) -> bool:
    """Make a byte-level tokenizer.json split every digit off on its own before its ByteLevel
    pre-tokenizer, as llama.cpp's "smollm" pre-tokenizer does (and SmolLM2's own tokenizer):
    "  12" is then "  ", "1", "2" and not " ", " 1", "2". Returns whether the file changed
    (False where it splits digits already or is not byte-level)."""
    data = json.loads(tokenizer_json.read_text())
    pre = data.get("pre_tokenizer")
    if not isinstance(pre, dict) or pre.get("type") != "ByteLevel":
        return False
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, pre],
    }
    tmp = tokenizer_json.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, ensure_ascii=False))
    os.replace(tmp, tokenizer_json)
    return True
