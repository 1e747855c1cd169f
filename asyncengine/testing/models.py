"""Builders of tiny random-weight models of real architectures, saved like hub checkpoints.

The tests load them through the engine's real loading code, and compare against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_VOCAB_SIZE = 512


def _tiny_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over a fixed vocabulary with byte-ish fallbacks, fully offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = [
        "the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "he", "for", "on",
        "are", "with", "as", "I", "his", "they", "be", "at", "one", "have", "this", "from",
        "hello", "world", "engine", "token", "cache", "block", "fast", "async", "model",
    ]  # fmt: skip
    vocab: dict[str, int] = {}
    for piece in specials + ["▁" + w for w in words] + words + ["▁" + c for c in letters] + letters:
        vocab.setdefault(piece, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"▁w{i}", len(vocab))
        i += 1
    tokenizer = Tokenizer(
        models.WordPiece(vocab=vocab, unk_token="<unk>", continuing_subword_prefix="")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return _wrap(tokenizer)


def _wrap(tokenizer: Any) -> Any:
    """A transformers tokenizer around a `tokenizers` one, with our special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


# What the byte-level tokenizer learns its merges from: JSON-ish text, so that structured
# outputs tests see multi-character tokens such as '{"', '":', 'true' and digit runs.
_BYTE_CORPUS = [
    '{"name": "hello", "age": 12, "ok": true, "items": [1, 2, 3], "x": null}',
    '{"id": 7, "tags": ["a", "b"], "score": -3.5e2, "nested": {"k": false}}',
    "the engine is fast and async; a token, a block, a cache.",
    "0123456789 -+.eE []{}:, true false null",
]


def _ascii_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer over printable ASCII (every such character is a token, plus
    merges learned from a little JSON), trained offline in milliseconds. It is smaller than
    `vocab_size`: the model's vocabulary is padded, as real checkpoints' often are.

    Printable ASCII only: a random model then cannot write raw control characters or stray
    UTF-8 bytes, which xgrammar lets through inside JSON strings (docs/structured_outputs.md)."""
    # GPT-2's byte-to-character map: '!'..'~' map to themselves, the space to 'Ġ'.
    return _byte_level_bpe(vocab_size, [chr(b) for b in range(33, 127)] + ["\u0120"])


def _bytes_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer over all 256 bytes (every byte is a token, control
    characters and the bytes of multi-byte UTF-8 characters included, plus merges learned
    from a little JSON): a random model with it can write any byte sequence, so it finds
    whatever a grammar lets through (raw control characters, surrogates, overlong UTF-8)."""
    from tokenizers import pre_tokenizers

    return _byte_level_bpe(vocab_size, pre_tokenizers.ByteLevel.alphabet())


def _byte_level_bpe(vocab_size: int, alphabet: list[str]) -> Any:
    """A byte-level BPE tokenizer whose base tokens are `alphabet` (GPT-2's byte-to-character
    map), with merges learned from a little JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_BYTE_CORPUS * 8, trainer)
    return _wrap(tokenizer)


def _config(arch: str, **overrides: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}: one of {', '.join(TINY_ARCHITECTURES)}")


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "words",
    **overrides: Any,
) -> Path:
    """Build a random-weight `arch` model (see TINY_ARCHITECTURES) and save it to `path`.

    `overrides` change the transformers config (hidden_size, num_hidden_layers, ...).
    `tokenizer`: "words" (a word-level vocabulary of letters and common words), "ascii"
    (byte-level BPE over printable ASCII: it spells JSON; smaller than the model's vocabulary)
    or "bytes" (byte-level BPE over all 256 bytes: it can spell any text, and any invalid
    UTF-8 too; also smaller than the model's vocabulary).
    Returns the folder, which holds config.json, model.safetensors and tokenizer files.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    # Random init gives near-uniform logits; a wider spread keeps greedy argmax far from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if "embed" not in name else 1.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    if tokenizer == "words":
        _tiny_tokenizer(config.vocab_size).save_pretrained(path)
    elif tokenizer == "ascii":
        _ascii_tokenizer(config.vocab_size).save_pretrained(path)
    elif tokenizer == "bytes":
        _bytes_tokenizer(config.vocab_size).save_pretrained(path)
    else:
        raise ValueError(f"tokenizer={tokenizer!r} is invalid: must be 'words', 'ascii' or 'bytes'")
    # Record that this is a plain random checkpoint for anyone looking at the folder.
    (path / "asyncengine_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return path
