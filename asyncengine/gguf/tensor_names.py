"""GGUF tensor names → Hugging Face names, and llama.cpp's q/k row order.

llama.cpp names a decoder's tensors `token_embd`, `blk.N.<part>`, `output_norm`, `output`
(gguf-py's tensor_mapping.py); Llama, Mistral, Qwen2 and Qwen3 use the same parts, Qwen2 with
q/k/v biases and Qwen3 with per-head q/k RMSNorms.

## The q/k permutation (`general.architecture == "llama"` files only)

For `general.architecture == "llama"` (Llama, and Mistral, which llama.cpp converts as llama)
llama.cpp's converter (convert_hf_to_gguf.py,
`LlamaModel.permute`) reorders the rows of `attn_q.weight` and `attn_k.weight` (and of their
biases, if any) inside each head, because llama.cpp's rotary for llama rotates adjacent pairs
(GPT-J style, `x[2i], x[2i+1]`) while Hugging Face's Llama rotates the two halves of a head
(`x[i], x[i + D/2]`):

    gguf_row(h, 2*i + j) = hf_row(h, j*D/2 + i)      for i < D/2, j in {0, 1}

with D the head dim and h the head (query heads for q, KV heads for k). So, inverting it,

    hf_row(h, j*D/2 + i) = gguf_row(h, 2*i + j)

which is exactly what transformers' GGUF loader undoes (`LlamaTensorProcessor
._reverse_permute_weights`: reshape `(n_head, D/2, 2, in)`, swap axes 1 and 2). Only whole rows
move; each row's values (the input features, along which quantized blocks run) are untouched, so
a quantized tensor is put back in HF order by gathering its rows of bytes, with no dequantizing
(`hf_row_order` gives the gather index). A consumer may instead keep the file's order and apply
GPT-J-style (interleaved) rotary to q and k: attention scores are the same either way. Qwen2 and
Qwen3 files are not permuted (llama.cpp runs them with NeoX rotary, the halves, as HF does).
Neither are `attn_v`, `attn_output`, nor Qwen3's q/k norms. A file that states
`general.architecture == "mistral"` is not something llama.cpp writes or runs; like transformers
(whose un-permuting is keyed on "llama") we take it as unpermuted.
"""

from __future__ import annotations

import re

# Parts of a block: GGUF name → HF name under model.layers.N.
_BLOCK_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# Tensors a file may hold that have no HF parameter: llama.cpp's per-frequency rope divisors
# (Llama 3.1+ "llama3" rope scaling is baked into this tensor instead of the metadata).
NON_PARAMETER_TENSORS = ("rope_freqs.weight",)

# Architectures whose q/k rows llama.cpp's converter permutes (see the module docstring).
PERMUTED_QK_ARCHITECTURES = ("llama",)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None if it is not one we know."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_PARTS:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_PARTS[match[2]]}.{match[3]}"


def expected_hf_names(
    architecture: str, num_layers: int, *, tied: bool, qkv_bias: bool
) -> list[str]:
    """Every HF parameter a model of this architecture must have (biases where the file has
    them for llama/mistral; Qwen2 always has q/k/v biases; Qwen3 its q/k norms)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    for n in range(num_layers):
        p = f"model.layers.{n}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if qkv_bias or architecture == "qwen2":
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if architecture == "qwen3":
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def permuted_heads(
    architecture: str, gguf_name: str, num_heads: int, num_kv_heads: int
) -> int | None:
    """How many heads' rows llama.cpp interleaved in this tensor, or None if it did not."""
    if architecture not in PERMUTED_QK_ARCHITECTURES:
        return None
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(match[2])


def hf_row_order(num_rows: int, num_heads: int) -> list[int]:
    """The gather index that puts a permuted q/k tensor's rows in HF order:
    `hf_rows = gguf_rows[hf_row_order(...)]` (see the module docstring)."""
    head_dim = num_rows // num_heads
    if head_dim * num_heads != num_rows or head_dim % 2:
        raise ValueError(f"{num_rows} rows do not split into {num_heads} heads of even size")
    half = head_dim // 2
    return [h * head_dim + 2 * i + j for h in range(num_heads) for j in (0, 1) for i in range(half)]
