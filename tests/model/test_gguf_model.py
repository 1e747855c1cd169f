"""A GGUF file's config and tensor names, against what transformers' own GGUF loader makes of
the same file; and the q/k row order of llama files."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402
from gguf import quants  # noqa: E402
from test_gguf_files import ARCHITECTURES, expected_values, write_tiny_gguf  # noqa: E402

from asyncengine.gguf import hf_row_order, hf_tensor_name, read_gguf  # noqa: E402
from asyncengine.gguf.tensor_names import expected_hf_names  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _transformers_config(path: Path) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config: dict = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config.pop("_model_name_or_path", None)
    return config


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_config_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    tiny = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, weight_type=Q.Q8_0, tied=tied)
    ours = read_gguf(tiny.path).hf_config
    theirs = _transformers_config(tiny.path)
    assert {k: ours.get(k) for k in theirs} == theirs
    s = tiny.shapes
    assert ours["architectures"] == [
        {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]  # fmt: skip
    assert (ours["hidden_size"], ours["intermediate_size"], ours["num_hidden_layers"]) == (
        s.hidden,
        s.intermediate,
        s.layers,
    )
    assert (ours["num_attention_heads"], ours["num_key_value_heads"], ours["head_dim"]) == (
        s.heads,
        s.kv_heads,
        s.head_dim,
    )
    assert ours["max_position_embeddings"] == s.context
    assert ours["vocab_size"] == tiny.vocab_size
    assert ours["tie_word_embeddings"] is tied
    assert ours["rms_norm_eps"] == pytest.approx(1e-6)
    assert ours["torch_dtype"] == "bfloat16"


def test_config_feeds_a_transformers_model(tmp_path: Path) -> None:
    """The dict is a config.json transformers accepts, with the shapes of the tensors."""
    from transformers import AutoConfig

    tiny = write_tiny_gguf(tmp_path / "q3.gguf", "qwen3")
    model = read_gguf(tiny.path)
    config = AutoConfig.for_model(**model.hf_config)
    assert config.head_dim == tiny.shapes.head_dim  # Qwen3Config's default would be 128
    assert model.tensors["model.layers.0.self_attn.q_norm.weight"].shape == (config.head_dim,)


def test_mistral_converted_by_llama_cpp_runs_as_llama(tmp_path: Path) -> None:
    """llama.cpp writes Mistral as "llama" (q/k permuted) and runs it as Llama; transformers
    too reads such a file as llama."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", name="mistral-7b-instruct")
    model = read_gguf(tiny.path)
    assert model.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert model.hf_config["model_type"] == _transformers_config(tiny.path)["model_type"]
    assert model.tensors["model.layers.0.self_attn.q_proj.weight"].permuted_heads == 4


def test_dtype_follows_the_weights(tmp_path: Path) -> None:
    for weight_type, dtype in ((Q.F32, "float32"), (Q.F16, "float16"), (Q.BF16, "bfloat16"),
                               (Q.Q4_0, "bfloat16")):  # fmt: skip
        tiny = write_tiny_gguf(
            tmp_path / f"{weight_type.name}.gguf", "qwen2", weight_type=weight_type
        )
        assert read_gguf(tiny.path).hf_config["torch_dtype"] == dtype


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    extra = {
        "llama.rope.scaling.type": ("linear", V.STRING),
        "llama.rope.scaling.factor": (4.0, V.FLOAT32),
        "llama.rope.scaling.original_context_length": (64, V.UINT32),
    }
    tiny = write_tiny_gguf(tmp_path / "r.gguf", "llama", extra_kv=extra)
    assert read_gguf(tiny.path).hf_config["rope_scaling"] == {
        "rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64,
    }  # fmt: skip


def test_rope_freqs_tensor_is_kept_apart(tmp_path: Path) -> None:
    freqs = np.ones(8, dtype=np.float32)
    tiny = write_tiny_gguf(
        tmp_path / "l31.gguf", "llama", extra_tensors={"rope_freqs.weight": (freqs, Q.F32)}
    )
    model = read_gguf(tiny.path)
    assert list(model.extra_tensors) == ["rope_freqs.weight"]
    np.testing.assert_array_equal(model.extra_tensors["rope_freqs.weight"].view(), freqs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_name_mapping_covers_every_tensor(tmp_path: Path, arch: str) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch)
    reader = gguf.GGUFReader(tiny.path)
    mapped = {hf_tensor_name(t.name) for t in reader.tensors}
    assert None not in mapped
    assert mapped == set(tiny.weights)
    layers = tiny.shapes.layers
    assert set(expected_hf_names(arch, layers, tied=False, qkv_bias=False)) == set(tiny.weights)


def test_name_mapping_matches_gguf_package() -> None:
    """Our names equal gguf-py's HF → GGUF table (what llama.cpp's converter uses)."""
    for arch_name in ("llama", "qwen2", "qwen3"):
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
        table = gguf.get_tensor_name_map(arch, 2)
        for hf in expected_hf_names(arch_name, 2, tied=False, qkv_bias=True):
            stem, suffix = hf.rsplit(".", 1)
            name = table.get_name(stem)
            assert name is not None, hf
            assert hf_tensor_name(f"{name}.{suffix}") == hf


def test_hf_row_order_inverts_llama_cpp_permute() -> None:
    from test_gguf_files import llama_permute

    for heads, head_dim in ((4, 16), (3, 64), (1, 2)):
        rows = np.arange(heads * head_dim)
        assert list(llama_permute(rows, heads)[hf_row_order(len(rows), heads)]) == list(rows)
    # Head 0, head_dim 8: HF rows 0..7 are GGUF rows 0, 2, 4, 6, 1, 3, 5, 7.
    assert hf_row_order(8, 1) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_llama_qk_rows_match_transformers_loader(tmp_path: Path) -> None:
    """transformers' GGUF loader un-permutes llama q/k; gathering our quantized rows in
    `hf_row_order` (no dequantizing before it) gives the same weights."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tiny = write_tiny_gguf(tmp_path / "l.gguf", "llama", weight_type=Q.Q8_0)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="l.gguf")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    theirs = load_gguf_checkpoint(str(tiny.path), return_tensors=True, model_to_load=skeleton)
    model = read_gguf(tiny.path)
    for name, t in model.tensors.items():
        ours = quants.dequantize(t.hf_rows(), Q(t.ggml_type)).reshape(t.shape)
        np.testing.assert_array_equal(ours, theirs["tensors"][name].numpy(), err_msg=name)
        np.testing.assert_array_equal(ours, expected_values(tiny, name), err_msg=name)
