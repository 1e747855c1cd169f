"""Build the lean CPU forward straight from a GGUF file (`asyncengine.gguf`), weights kept
as the file stores them.

- Quantized weights stay quantized: `QuantLinear` over a copy of their blocks (next point),
  or, with the arena off (`weight_arena.ENABLED`), over a zero-copy view of the file's
  mapping (the view holds the mapping, so it lives as long as the model). llama-arch files
  store q/k rows permuted per head (llama.cpp's converter): those two tensors are copied with
  their rows (whole blocks) put back in HF order. On AVX512-VNNI, Q4_K, Q8_0, Q5_0, Q4_0 and
  Q6_K weights are copied 8 rows interleaved instead (`decode_layout`), the file's pages of them
  released.
- Every quantized weight the products read is copied into one `WeightArena` of the load (the
  weights side by side on huge pages, the file's pages released): a decode step streams
  through them faster than through the file's 4 KiB pages (`weight_arena.py`).
- q/k/v and gate/up of one quantized type are joined into one layer each (their rows
  concatenated into a copy, the file's pages released): one product reads them as one stream
  with one handoff to the threads instead of three or two (SmolLM2 Q8_0 decode 6.16 -> 5.74 ms
  a token on 2 Zen 4 cores). Where their types differ (Q4_K_M's Q6_K v) they stay separate.
- F32 / F16 / BF16 tensors are converted to the engine's dtype, and their linears joined
  and packed as `cpu_checkpoint` does for safetensors.
- A quantized token embedding is looked up a step's rows at a time (`QuantEmbedding`); a
  quantized lm_head (most GGUF files tie it to the embedding) is a `QuantLinear`, so the
  model returns logits (the int8 lm_head screen reads packed bf16 weights only). A tied one
  is laid out as the products read it fastest, and the lookup reads that copy.

In bf16, decode steps run the layers in the one native call (`decode_layers.py`) where the
native kernels run every quantized format the file holds; otherwise one op at a time.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncengine.config import ModelConfig
from asyncengine.gguf import GGUFModel, GGUFTensor, read_gguf
from asyncengine.gguf.ggml_types import FLOAT_TYPES, SUPPORTED_TYPES, GGMLType
from asyncengine.gguf.serving import check_runnable
from asyncengine.heap import release_free_heap
from asyncengine.kernels.quant_cpu import decode_layout
from asyncengine.model.cpu_forward import CpuForward, joint_weights
from asyncengine.model.cpu_linear import linear_layer
from asyncengine.model.lean_layer import LeanLayer
from asyncengine.model.quant_linear import QuantEmbedding, QuantLinear
from asyncengine.model.rope import RopeSpec, RotaryEmbedding
from asyncengine.model.weight_arena import WeightArena

# the quantized types, by their names in kernels/quant_formats.py ("q4_k")
_QTYPES = {t: t.name.lower() for t in SUPPORTED_TYPES if t not in FLOAT_TYPES}
_DEFAULT_EPS = 1e-6
# q/k/v and gate/up weights of one quantized type are joined into one layer each (see
# `_Loader.joint_linear`). Set to False to compare.
JOIN_QUANTIZED = True


def gguf_reason(model_config: ModelConfig) -> str | None:
    """Why `load_gguf_forward` cannot run this GGUF model (None: it can); reads the header."""
    if model_config.attention_backend != "cpu":
        return f"attention backend {model_config.attention_backend!r}, not 'cpu'"
    model = read_gguf(model_config.model)
    try:
        check_runnable(model)
        RopeSpec.from_hf_config(model.hf_config, model_config.head_dim)
    except ValueError as exc:
        return str(exc)
    finally:
        model.close()
    return None


def load_gguf_forward(model_config: ModelConfig) -> CpuForward:
    """The lean forward over the GGUF file `model_config.model`, on the CPU."""
    model = read_gguf(model_config.model)
    check_runnable(model)
    loader = _Loader(model, getattr(torch, model_config.dtype))
    hf = model.hf_config
    eps = float(hf.get("rms_norm_eps", _DEFAULT_EPS))
    rope = RopeSpec.from_hf_config(hf, model_config.head_dim)
    layers = [
        _load_layer(loader, i, eps, rope.head_dim, model_config.num_kv_heads)
        for i in range(model_config.num_layers)
    ]
    embed = model.tensors["model.embed_tokens.weight"]
    head = model.tensors.get("lm_head.weight", embed)  # tied: the embedding
    embed_weight = embed_rows = None
    lm_head = loader.linear(head, None)
    if embed.ggml_type not in _QTYPES:
        embed_weight = loader.values(embed)
    elif head is embed and isinstance(lm_head, QuantLinear):
        # tied: the lookup reads the lm_head's copy (maybe interleaved; the file's pages of
        # it released), so the weight is in memory once
        embed_rows = QuantEmbedding(lm_head.qweight, lm_head.qtype, loader.dtype)
    else:
        embed_rows = QuantEmbedding(loader.blocks(embed), _QTYPES[embed.ggml_type], loader.dtype)
    forward = CpuForward(
        embed_weight=embed_weight,
        embed_rows=embed_rows,
        rotary=RotaryEmbedding(rope, _rope_freqs(model, rope.head_dim)),
        final_norm=loader.values(model.tensors["model.norm.weight"]),
        final_eps=eps,
        lm_head=lm_head,
        head_dim=model_config.head_dim,
        layers=layers,
    )
    # The quantized weights view the mapping and keep it; the header's objects can go.
    release_free_heap()
    return forward


def _rope_freqs(model: GGUFModel, head_dim: int) -> torch.Tensor | None:
    """The file's `rope_freqs` tensor (Llama 3.1-style scaling as llama.cpp's converter stores
    it: a divisor per rotary frequency), float32 [head_dim / 2]; None without one."""
    tensor = model.extra_tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    return torch.from_numpy(np.array(tensor.view(), dtype=np.float32)).reshape(head_dim // 2)


class _Loader:
    """Tensors of the file as the forward takes them."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        # the weights the products read, side by side (model/weight_arena.py)
        self.arena = WeightArena()

    def get(self, name: str) -> GGUFTensor | None:
        return self.model.tensors.get(name)

    def values(self, tensor: GGUFTensor) -> torch.Tensor:
        """A float tensor in the engine's dtype (a copy), rows in HF order."""
        # a copy: writable, and the file's pages are not kept for it
        array = np.array(tensor.hf_rows() if len(tensor.shape) == 1 else _float_rows(tensor))
        if tensor.ggml_type == GGMLType.BF16:
            return torch.from_numpy(array).view(torch.bfloat16).to(self.dtype).contiguous()
        return torch.from_numpy(array).to(self.dtype).contiguous()

    def blocks(self, tensor: GGUFTensor) -> torch.Tensor:
        """A quantized tensor's blocks, uint8 [rows, row bytes]: a view of the file's mapping,
        or, where llama.cpp permuted the rows, a copy with the rows in HF order."""
        if tensor.permuted_heads is not None:
            return torch.from_numpy(np.ascontiguousarray(tensor.hf_rows()))
        with warnings.catch_warnings():
            # The mapping is read-only and the weights are never written.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(tensor.memoryview(), dtype=torch.uint8)
        return flat.view(tensor.num_rows, tensor.row_nbytes)

    def linear(self, weight: GGUFTensor, bias: GGUFTensor | None) -> nn.Module:
        """A quantized weight's layer reads the file's blocks in place, or (where the kernels
        read another layout faster: `decode_layout`) a copy in that layout, the file's pages
        of it released; a float weight's, its values in the engine's dtype."""
        b = None if bias is None else self.values(bias)
        if weight.ggml_type not in _QTYPES:
            return linear_layer(self.values(weight), b, self.arena)
        blocks, qtype = self.blocks(weight), _QTYPES[weight.ggml_type]
        copy, qtype = decode_layout(blocks, qtype, self.arena.empty)
        copy = self.arena.keep(copy)
        if copy is not blocks:
            blocks = copy
            weight.release_pages()
        return QuantLinear(blocks, qtype, b)

    def joint_linear(
        self, weights: list[GGUFTensor], biases: list[GGUFTensor | None]
    ) -> nn.Module | None:
        """One layer computing these quantized (not float) weights' products side by side
        (their rows joined, in the layout `decode_layout` picks), where they share a type and
        all or none have biases; None otherwise. One product instead of several reads the weights
        in one stream with one handoff to the threads (kernels/csrc/decode_layers.c)."""
        if not JOIN_QUANTIZED:
            return None
        types = {w.ggml_type for w in weights}
        has_bias = [b is not None for b in biases]
        if len(types) != 1 or any(has_bias) != all(has_bias):
            return None
        blocks = torch.cat([self.blocks(w) for w in weights])
        blocks, qtype = decode_layout(blocks, _QTYPES[types.pop()], self.arena.empty)
        blocks = self.arena.keep(blocks)
        for w in weights:
            w.release_pages()
        bias = None
        if all(has_bias):
            bias = torch.cat([self.values(b) for b in biases if b is not None])
        return QuantLinear(blocks, qtype, bias)


def _float_rows(tensor: GGUFTensor) -> Any:
    """A 2-D float tensor's values (`view()`), rows in HF order."""
    order = tensor.hf_row_order()
    values = tensor.view()
    return values if order is None else values[order]


def _load_layer(loader: _Loader, i: int, eps: float, head_dim: int, num_kv_heads: int) -> LeanLayer:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."

    def weight(name: str) -> GGUFTensor:
        tensor = loader.get(name + ".weight")
        assert tensor is not None, name  # read_gguf checked the file is complete
        return tensor

    def bias(name: str) -> GGUFTensor | None:
        return loader.get(name + ".bias")

    def norm(name: str) -> torch.Tensor | None:
        tensor = loader.get(name)
        return None if tensor is None else loader.values(tensor)

    def joint(names: list[str]) -> nn.Module | None:
        """One packed layer for float projections side by side, where that gives theirs."""
        weights = [weight(n) for n in names]
        biases = [bias(n) for n in names]
        if any(w.ggml_type not in FLOAT_TYPES for w in weights):
            return loader.joint_linear(weights, biases)
        joined = joint_weights(
            [loader.values(w) for w in weights],
            [None if b is None else loader.values(b) for b in biases],
        )
        return None if joined is None else linear_layer(*joined, arena=loader.arena)

    def linear(name: str) -> nn.Module:
        return loader.linear(weight(name), bias(name))

    qkv_names = [attn + f"{x}_proj" for x in "qkv"]
    qkv = joint(qkv_names)
    q_proj = k_proj = v_proj = None
    if qkv is None:
        q_proj, k_proj, v_proj = (linear(n) for n in qkv_names)
    gate_up = joint([mlp + "gate_proj", mlp + "up_proj"])
    gate_proj = up_proj = None
    if gate_up is None:
        gate_proj, up_proj = linear(mlp + "gate_proj"), linear(mlp + "up_proj")
    return LeanLayer(
        input_norm=_required(norm(p + "input_layernorm.weight")),
        post_norm=_required(norm(p + "post_attention_layernorm.weight")),
        eps=eps,
        qkv=qkv,
        q_proj=q_proj,
        k_proj=k_proj,
        v_proj=v_proj,
        q_norm=norm(attn + "q_norm.weight"),
        k_norm=norm(attn + "k_norm.weight"),
        head_eps=eps,
        num_kv_heads=num_kv_heads,
        o_proj=linear(attn + "o_proj"),
        gate_up=gate_up,
        gate_proj=gate_proj,
        up_proj=up_proj,
        down_proj=linear(mlp + "down_proj"),
        scale=head_dim**-0.5,
    )


def _required(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor
