"""A model folder's own files, read with the json module only (the client side never imports
torch or transformers' model code): config.json (or a GGUF file's metadata as one), the
architecture and length it names, and generation_config.json's EOS ids and sampling
defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncengine.gguf.serving import gguf_hf_config, is_gguf_file

# generation_config.json's sampling fields → SamplingParams' names (vLLM applies the same).
GENERATION_SAMPLING_FIELDS = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
    ("max_new_tokens", "max_tokens"),
)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    if is_gguf_file(model_dir):  # resolve_model checked it: its config is its metadata's
        return gguf_hf_config(model_dir)
    if not model_dir.is_dir():
        raise ValueError(
            f"model={str(model_dir)!r} is not a directory: give a local Hugging Face model "
            "folder (config.json, *.safetensors, tokenizer files), or 'default' for the "
            "embedded default model; nothing is downloaded"
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model={str(model_dir)!r} has no config.json")
    with path.open() as f:
        hf: dict[str, Any] = json.load(f)
    # Multimodal wrappers keep the language model's settings in text_config.
    if "num_attention_heads" not in hf and isinstance(hf.get("text_config"), dict):
        hf = {**hf["text_config"], "architectures": hf.get("architectures")}
    for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in hf:
            raise ValueError(f"{path} lacks {key!r}: is this a decoder-only language model?")
    return hf


def architecture(hf: dict[str, Any], model_dir: Path) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError(f"{model_dir}/config.json names no architecture ('architectures')")
    return str(archs[0])


def model_len_limit(hf: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(hf.get(key), int):
            return int(hf[key])
    return 2048


def eos_token_ids(hf: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (hf, generation):
        eos = src.get("eos_token_id")
        for tok in eos if isinstance(eos, list) else [eos]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def read_generation_config(model_dir: Path, source: object) -> dict[str, Any]:
    """generation_config.json of the model folder ("auto", and "vllm": its eos ids are still
    the model's), or of the folder `source` names; {} where there is none."""
    if not isinstance(source, str) or not source:
        raise ValueError(
            f"generation_config={source!r} is invalid: must be 'auto' (the model's sampling "
            "defaults), 'vllm' (none) or a folder holding a generation_config.json"
        )
    folder = model_dir if source in ("auto", "vllm") else Path(source).expanduser()
    path = folder / "generation_config.json"
    if source not in ("auto", "vllm") and not path.is_file():
        raise ValueError(f"generation_config={source!r}: {path} does not exist")
    if not path.is_file():
        return {}
    try:
        with path.open() as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def sampling_defaults(
    generation: dict[str, Any], source: str
) -> tuple[tuple[str, float | int], ...]:
    """The sampling fields of a generation config that requests inherit (vLLM's list), each
    checked as SamplingParams checks it: a bad file is an error naming it at load, not a
    failure of every request later."""
    if source == "vllm":
        return ()
    from asyncengine.sampling_params import SamplingParams

    found: dict[str, float | int] = {}
    for hf_name, name in GENERATION_SAMPLING_FIELDS:
        value = generation.get(hf_name)
        if value is not None:
            found[name] = value
    try:
        SamplingParams(**found)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the model's generation_config.json has an invalid sampling default: {exc} "
            "(fix the file, or pass generation_config='vllm' to ignore its defaults)"
        ) from None
    return tuple(sorted(found.items()))
