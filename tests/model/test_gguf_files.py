"""Tiny GGUF files for the GGUF tests, written with the `gguf` package's GGUFWriter the way
llama.cpp's converter writes them (llama q/k rows permuted per head), plus checks that the
files are what the other tests assume.

`write_tiny_gguf` returns the HF-named float32 weights it wrote (before quantizing and before
llama.cpp's permutation), so tests can compare what the reader gives back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ["H e", "l l", "o Ġ", "He ll", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


@dataclass
class Shapes:
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    context: int = 256


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    shapes: Shapes
    vocab_size: int
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # HF name -> fp32, HF order
    types: dict[str, int] = field(default_factory=dict)  # HF name -> ggml type written


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small GPT-2-style byte-level BPE vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in _MERGES]
    types = [1] * len(tokens)
    tokens += list(SPECIAL)
    types += [3] * len(SPECIAL)  # CONTROL
    return tokens, types, list(_MERGES)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (HF rows → GGUF rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_weights(arch: str, s: Shapes, vocab: int, tied: bool, rng: np.random.Generator) -> dict:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    w = {"model.embed_tokens.weight": rand(vocab, s.hidden), "model.norm.weight": rand(s.hidden)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for n in range(s.layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = 1 + rand(s.hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(s.hidden)
        w[p + "self_attn.q_proj.weight"] = rand(q, s.hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv, s.hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv, s.hidden)
        w[p + "self_attn.o_proj.weight"] = rand(s.hidden, q)
        w[p + "mlp.gate_proj.weight"] = rand(s.intermediate, s.hidden)
        w[p + "mlp.up_proj.weight"] = rand(s.intermediate, s.hidden)
        w[p + "mlp.down_proj.weight"] = rand(s.hidden, s.intermediate)
        if arch == "qwen2":
            for x, rows in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{x}_proj.bias"] = rand(rows)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + rand(s.head_dim)
            w[p + "self_attn.k_norm.weight"] = 1 + rand(s.head_dim)
    return w


_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    """The test's own HF → GGUF naming (independent of the code under test)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, n, *rest = hf_name.split(".")
    part, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{n}.{_GGUF_PARTS[part]}.{kind}"


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    weight_type: int = Q.F32,
    embed_type: int | None = None,
    tied: bool = False,
    tokenizer: bool = True,
    name: str = "tiny",
    seed: int = 0,
    shapes: Shapes | None = None,
    extra_kv: dict[str, Any] | None = None,
    file_arch: str | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, int]] | None = None,
    type_overrides: dict[str, int] | None = None,
    tokenizer_pre: str = "qwen2",
    vocab_multiple: int = 1,
) -> TinyGGUF:
    """A tiny random model of `arch` as llama.cpp would write it: 2-D weights of
    `weight_type` (F32, F16, BF16 or a type gguf.quants.quantize knows), norms and biases F32.
    `type_overrides` maps a part of an HF name ("v_proj") to the type of the 2-D weights
    whose names hold it (a mix, as llama-quantize's Q4_K_M writes). `file_arch` overrides
    general.architecture (an unsupported one, for the error tests). `vocab_multiple` pads
    the vocabulary with control tokens to a multiple of it (as many real files are)."""
    s = shapes or Shapes()
    tokens, types, merges = byte_level_vocab()
    while len(tokens) % vocab_multiple:
        tokens.append(f"<|extra_{len(tokens)}|>")
        types.append(3)  # CONTROL
    rng = np.random.default_rng(seed)
    weights = _hf_weights(arch, s, len(tokens), tied, rng)
    out = TinyGGUF(path, arch, s, len(tokens), weights)
    file_arch = file_arch or arch
    w = gguf.GGUFWriter(str(path), file_arch)
    w.add_name(name)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch != "qwen2" else 1e6)
    w.add_rope_dimension_count(s.head_dim)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_vocab_size(len(tokens))
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    for hf_name, value in weights.items():
        stored = value
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            stored = llama_permute(value, s.heads if ".q_proj." in hf_name else s.kv_heads)
        qtype = Q.F32
        if value.ndim == 2:
            qtype = embed_type if (embed_type is not None and "embed" in hf_name) else weight_type
            for part, override in (type_overrides or {}).items():
                qtype = override if part in hf_name else qtype
        out.types[hf_name] = qtype
        _add(w, gguf_name(hf_name), stored, qtype)
    for tname, (value, qtype) in (extra_tensors or {}).items():
        _add(w, tname, value, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w: Any, name: str, value: np.ndarray, qtype: int) -> None:
    if value.dtype == np.uint8:  # raw blocks, already in `qtype`
        w.add_tensor(name, value, raw_dtype=Q(qtype))
    elif qtype == Q.F32:
        w.add_tensor(name, value.astype(np.float32))
    elif qtype == Q.F16:
        w.add_tensor(name, value.astype(np.float16))
    else:
        w.add_tensor(name, quantize(value, qtype), raw_dtype=Q(qtype))


def quantize(value: np.ndarray, qtype: int) -> np.ndarray:
    """`value` [N, K] as `qtype` blocks: gguf-py's quantizer, or for the K-quants (which
    gguf-py cannot write) `quantize_k`."""
    if qtype in K_QUANTS:
        return quantize_k(value, qtype)
    return np.asarray(quants.quantize(value, Q(qtype)))


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [blocks, 2]


def quantize_k(value: np.ndarray, qtype: int) -> np.ndarray:
    """`value` [N, K] (K a multiple of 256) as Q4_K, Q5_K or Q6_K blocks, by a plain
    quantizer: each sub-block's range (Q6_K: its largest magnitude) in 6-bit (int8) scales of
    the super-block's fp16 ones, round to nearest. Not llama.cpp's search for the best scales,
    but the same layout (kernels/quant_formats.py), so what it writes is what a file holds."""
    n = value.shape[0]
    x = value.astype(np.float32).reshape(-1, 256)  # super-blocks
    blocks = x.shape[0]
    if qtype == Q.Q6_K:
        sub = x.reshape(blocks, 16, 16)
        scale = np.abs(sub).max(-1) / 31  # [blocks, 16]
        d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)  # [blocks]
        inv_d = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        sc = np.clip(np.round(scale * inv_d[:, None]), -128, 127).astype(np.int8)
        step = d[:, None] * sc  # [blocks, 16]
        inv = np.divide(1, step, out=np.zeros_like(step), where=step > 0)
        q = (np.clip(np.round(sub * inv[..., None]), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(blocks, 2, 4, 32)  # halves of 128: four runs of 32
        ql = np.concatenate(
            [
                (q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4,
                (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4,
            ],
            -1,
        )
        qh = (
            (q[:, :, 0] >> 4)
            | (q[:, :, 1] >> 4) << 2
            | (q[:, :, 2] >> 4) << 4
            | (q[:, :, 3] >> 4) << 6
        )
        raw = np.concatenate(
            [ql.reshape(blocks, 128), qh.reshape(blocks, 64), sc.view(np.uint8), _f16_bytes(d)], -1
        )
        return raw.reshape(n, -1)
    levels = 15 if qtype == Q.Q4_K else 31
    sub = x.reshape(blocks, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # [blocks, 8]
    scale = (sub.max(-1) - low) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    inv_d = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
    inv_m = np.divide(1, dmin, out=np.zeros_like(dmin), where=dmin > 0)
    sc = np.clip(np.round(scale * inv_d[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low * inv_m[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    inv = np.divide(1, step, out=np.zeros_like(step), where=step > 0)
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.round((sub + offset) * inv[..., None]), 0, levels).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            m[:, :4] | (m[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4,
        ],
        -1,
    )
    q = q.reshape(blocks, 4, 2, 32)  # chunks of 64: sub-blocks 2c (low nibbles), 2c + 1 (high)
    qs = ((q[:, :, 0] & 15) | (q[:, :, 1] & 15) << 4).reshape(blocks, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if qtype == Q.Q5_K:
        bits = q >> 4  # [blocks, 4, 2, 32]
        shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
        parts.append((bits << shifts[None, :, :, None]).sum(axis=(1, 2)).astype(np.uint8))
    return np.concatenate([*parts, qs], -1).reshape(n, -1)


def expected_values(tiny: TinyGGUF, hf_name: str) -> np.ndarray:
    """What the file holds for `hf_name`, dequantized, in HF row order."""
    value, qtype = tiny.weights[hf_name], tiny.types[hf_name]
    if qtype == Q.F32:
        return value
    if qtype == Q.F16:
        return value.astype(np.float16).astype(np.float32)
    return quants.dequantize(quantize(value, qtype), Q(qtype)).reshape(value.shape)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_files_read_back_with_gguf_reader(tmp_path: Path, arch: str) -> None:
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch, weight_type=Q.Q8_0)
    reader = gguf.GGUFReader(tiny.path)
    names = {t.name for t in reader.tensors}
    assert names == {gguf_name(n) for n in tiny.weights}
    assert reader.fields["general.architecture"].contents() == arch


def test_llama_permute_is_what_transformers_undoes() -> None:
    """The test's llama.cpp permutation and transformers' reverse are inverses."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    back = LlamaTensorProcessor()._reverse_permute_weights(llama_permute(w, 4), 4, 4)
    np.testing.assert_array_equal(back, w)
