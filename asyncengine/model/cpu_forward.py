"""A lean forward pass for Llama-family models on CPU, on the native kernels.

transformers' decoder layer costs about 30 torch ops and a dozen Python calls per layer besides
its GEMMs: at SmolLM2's size (30 layers, 64-token decode steps) that is a fifth of a step. This
forward runs the same arithmetic as `LlamaForCausalLM.forward` (and Mistral's, Qwen2's,
Qwen3's) in eight calls a layer:

    residual += mlp_out; x = norm(residual)       one kernel (the first layer: the norm only)
    qkv = x @ W_qkv                                one GEMM: q, k and v weights side by side
    q, k = rotary(q, k); cache <- k, v             one kernel, in place (after Qwen3's q/k norms)
    attn = paged attention                         the "cpu" attention backend, as before
    residual += attn @ W_o; x = norm(residual)     a GEMM and one kernel
    mlp_out = down(silu(gate) * up)                a GEMM (gate and up side by side), one
                                                   kernel, a GEMM

and takes the final norm and the lm_head on the sampled rows only. Every op rounds where
transformers' rounds, so the numbers are the same: bf16 logits bit for bit, fp32 ones up to
the summation order of the RMSNorms (tests/model/test_cpu_forward.py). The side-by-side
weights are used only for bf16/fp16 and where a probe shows that the joint GEMM gives the
separate GEMMs' numbers to the bit; otherwise the projections stay apart.

Most checkpoints it takes are built straight from their files by `cpu_checkpoint.py`, without
transformers. A model loaded through transformers takes two calls, around the CPU weight
packing (which replaces linear modules):

- `join_projections(model)` before it: for a model `unsupported_reason` accepts, replaces each
  layer's q/k/v projections by one `qkv_proj` and gate/up by one `gate_up_proj` where the
  probe agrees. transformers' own forward can no longer run that model.
- `CpuForward.from_model(model)` after it: the forward, holding the final modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.argmax_cpu import argmax_cpu, argmax_nan_rows
from asyncengine.kernels.lm_head_argmax_cpu import ARGMAX_MAX_ROWS, LmHeadArgmax
from asyncengine.kernels.rms_norm_cpu import rms_norm_cpu
from asyncengine.kernels.rotary_cpu import rotary_cpu
from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu
from asyncengine.model.attention import AttentionMetadata
from asyncengine.model.cpu_linear import PackedLinear
from asyncengine.model.decode_layers import NativeDecodeLayers
from asyncengine.model.interface import TokenChoice
from asyncengine.model.lean_layer import LeanLayer
from asyncengine.model.lora_layers import LoRABatch
from asyncengine.model.quant_linear import QuantLinear

_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaDecoderLayer",
    "MistralForCausalLM": "MistralDecoderLayer",
    "Qwen2ForCausalLM": "Qwen2DecoderLayer",
    "Qwen3ForCausalLM": "Qwen3DecoderLayer",
}
_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_SILUS = frozenset({"SiLUActivation", "SiLU"})


Rotary = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class CpuForward:
    """`model(input_ids, positions, attn, logits_indices) -> logits [S, V]` for one step.

    Built from a transformers model (`from_model`) or straight from a checkpoint
    (`asyncengine.model.cpu_checkpoint`); the arguments are the weights it runs on.
    """

    def __init__(
        self,
        *,
        embed_weight: torch.Tensor | None,  # [V, hidden], plain: the lookup reads rows
        rotary: Rotary,  # (x, position_ids [1, T]) -> cos, sin [1, T, D], as transformers'
        final_norm: torch.Tensor,
        final_eps: float,
        lm_head: nn.Module,
        head_dim: int,
        layers: list[LeanLayer],
        embed_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        # The lookup: embed_rows(ids) where given (a tied embedding read from the lm_head's
        # packed weight, LinearCpu.rows), else rows of embed_weight.
        if embed_rows is None and embed_weight is None:
            raise ValueError("CpuForward needs embed_weight or embed_rows")
        self._embed_weight = embed_weight
        self._embed_rows = embed_rows
        self._rotary = rotary
        # RotaryEmbedding's table lookup; None for transformers' rotary module
        self._rotary_rows = getattr(rotary, "rows", None)
        self._final_norm = final_norm
        self._final_eps = final_eps
        self._lm_head = lm_head
        self._head_dim = head_dim
        self._layers = layers
        # The layers in one native call, where every projection is on a native linear kernel
        # (decode_layers.py); None: the Python loop below. Set it to None to compare.
        self.native_layers = NativeDecodeLayers.build(layers, head_dim)
        # Greedy steps' tokens from an int8 screen of the lm_head (kernels/lm_head_argmax_cpu),
        # where the lm_head is on the native kernels; None: logits always. Set it to None to
        # compare.
        self.lm_head_argmax = _lm_head_argmax(lm_head)
        # Its row limit: also the lm_head's native one, so its indices are of the same logits.
        self._argmax_rows = min(ARGMAX_MAX_ROWS, getattr(lm_head, "native_max_rows", 0))
        # A quantized lm_head has no screen (its blocks are already about the screen's bytes),
        # but its steps still pick their tokens here, from the logits, in one native pass:
        # the sampler's Python and torch ops cost a one-stream step of a small model ~0.1 ms
        # (more with the caches cold after the layers' weights went through them).
        self._pick_from_logits = isinstance(lm_head, QuantLinear) and lm_head.native

    @classmethod
    def from_model(cls, model: nn.Module) -> CpuForward:
        """The forward of a transformers model (after `join_projections` and the packing)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"CpuForward: {reason}")
        base: Any = model.model  # type: ignore[union-attr]
        head_dim = _head_dim(model)
        return cls(
            embed_weight=base.embed_tokens.weight,
            rotary=base.rotary_emb,
            final_norm=base.norm.weight,
            final_eps=float(base.norm.variance_epsilon),
            lm_head=model.lm_head,  # type: ignore[arg-type]
            head_dim=head_dim,
            layers=[_collect(layer, head_dim) for layer in base.layers],
        )

    @property
    def token_choice_rows(self) -> int:
        """The most rows it picks tokens for itself (ModelForward); 0 where it cannot."""
        if self._pick_from_logits:
            return ARGMAX_MAX_ROWS
        return self._argmax_rows if self.lm_head_argmax is not None else 0

    def linear_layers(self) -> list[nn.Module]:
        """Every projection it multiplies by, the lm_head last."""
        names = ("qkv", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up", "gate_proj",
                 "up_proj", "down_proj")  # fmt: skip
        found = [getattr(layer, n) for layer in self._layers for n in names]
        return [m for m in found if m is not None] + [self._lm_head]

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] rows whose logits are wanted
        token_choice: TokenChoice | None = None,
        hidden_indices: torch.Tensor | None = None,  # [H] rows whose hidden states are wanted
        hidden_out: list[torch.Tensor] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [S, V] logits, or [S] int64 token ids
        """The logits of the rows `logits_indices` names; with `token_choice`, possibly their
        tokens instead (see model/interface.py): through the int8 screen of the lm_head, for
        steps of a few rows. With `lora`, its adapters' rows get their low-rank adds (in the
        native all-layers call where it takes the step, else in the Python layer loop)."""
        if self._embed_rows is not None:
            residual = self._embed_rows(input_ids)  # [T, hidden]
        else:
            assert self._embed_weight is not None
            residual = F.embedding(input_ids, self._embed_weight)
        if self._rotary_rows is not None:
            cos, sin = self._rotary_rows(positions, residual.dtype)  # [T, D] each
        else:  # transformers' rotary module (a model built through transformers)
            cos, sin = self._rotary(residual, positions[None])  # [1, T, D] each
            cos, sin = cos[0], sin[0]
        if attn.backend.name != "cpu":  # the cache layout its rotary kernel writes
            raise ValueError(
                f"CpuForward runs on the 'cpu' attention backend, not {attn.backend.name!r}"
            )
        native = self.native_layers
        mlp_out = None
        if native is not None:
            mlp_out = native(residual, cos, sin, attn, lora)
        if mlp_out is None:
            down, x = self._layers_loop(residual, cos, sin, attn, lora)
            mlp_out = x if down is None else down(x)
        if hidden_indices is not None and hidden_out is not None:  # embedding requests' rows
            hidden_out.append(
                rms_norm_cpu(
                    mlp_out.index_select(0, hidden_indices), self._final_norm, self._final_eps,
                    residual.index_select(0, hidden_indices),
                )
            )  # fmt: skip
        # The last residual add and the final norm, on the sampled rows only (a one-token
        # step's row as it is: no copies).
        rows_out, rows_res = mlp_out, residual
        if mlp_out.shape[0] != 1 or logits_indices.shape[0] != 1:
            rows_out = mlp_out.index_select(0, logits_indices)
            rows_res = residual.index_select(0, logits_indices)
        hidden = rms_norm_cpu(rows_out, self._final_norm, self._final_eps, rows_res)
        screen, choice = self.lm_head_argmax, token_choice
        if choice is not None and screen is not None and len(hidden) <= self.token_choice_rows:
            tokens = screen(hidden, choice.vocab_size, choice.temperatures, choice.noise)
            if tokens is not None:  # else a row's logits are not finite: compute them
                return tokens
        logits: torch.Tensor = self._lm_head(hidden)
        if choice is not None and self._pick_from_logits and len(hidden) <= ARGMAX_MAX_ROWS:
            tokens = pick_tokens(logits, choice)
            if tokens is not None:  # else a row has a NaN logit: the sampler flags it
                return tokens
        return logits

    def _layers_loop(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> _Projection:
        """The decoder layers, a kernel call at a time: `residual` updated in place, and the
        last layer's MLP output (or its down projection and input) returned; with `lora`,
        each projection plus its adapters' deltas (model/lora_layers.py)."""
        num_tokens, d = residual.shape[0], self._head_dim
        backend, plan, slots = attn.backend, attn.plan, attn.slot_mapping
        mlp: _Projection | None = None  # the last layer's MLP output, or its down projection
        for i, layer in enumerate(self._layers):
            if mlp is None:
                x = rms_norm_cpu(residual, layer.input_norm, layer.eps)
            else:
                x = _add_rms_norm(mlp, residual, layer.input_norm, layer.eps)
            q, k, v = _project_qkv(layer, x, num_tokens, d)
            if lora is not None:
                lora.add_qkv(i, x, q, k, v)
            kv_cache = attn.kv_caches[i]
            # Rotary, and the cache write of the rotated keys and the values, in one pass.
            rotary_cpu(
                q, k, cos, sin, layer.q_norm, layer.k_norm, layer.head_eps,
                value=v, kv_cache=kv_cache, slot_mapping=slots,
            )  # fmt: skip
            out = backend.paged_attention(q, k, v, kv_cache, plan, layer.scale)  # [T, H_q, D]
            o_proj: _Projection = (layer.o_proj, out.view(num_tokens, -1))
            if lora is not None:
                o_proj = (None, lora.project(i, "o_proj", layer.o_proj, o_proj[1]))
            x = _add_rms_norm(o_proj, residual, layer.post_norm, layer.eps)
            mlp = _mlp(layer, x) if lora is None else (None, lora.mlp(i, layer, x))
        assert mlp is not None
        return mlp


def pick_tokens(logits: torch.Tensor, choice: TokenChoice) -> torch.Tensor | None:
    """The tokens `choice` describes, from `logits` [S, >= vocab]: the sampler's arithmetic
    (Sampler._sample) on the same noise, so bit for bit its picks. None where a row holds a
    NaN logit (argmax ranks NaN first; the sampler then fails that request alone)."""
    x = logits[:, : choice.vocab_size]
    tokens, nan_rows = argmax_nan_rows(x)  # [S]
    if nan_rows:
        return None
    if choice.temperatures is not None and choice.noise is not None:
        temps = choice.temperatures
        scores = (x.float() / temps.unsqueeze(1)).add_(choice.noise[:, : choice.vocab_size])
        tokens = torch.where(temps == 0, tokens, argmax_cpu(scores))
    return tokens


def _lm_head_argmax(lm_head: nn.Module) -> LmHeadArgmax | None:
    """The int8 screen of a bf16 lm_head on the native kernels (see LmHeadArgmax), else None."""
    if not isinstance(lm_head, PackedLinear) or lm_head.native is None:
        return None
    return LmHeadArgmax(lm_head.native)


# Prefill steps run the MLP in row chunks of about this many tokens: its [T, 2 * I]
# intermediate then stays in the cache between the GEMM that writes it and the kernel that
# reads it, and the step's peak memory drops by that intermediate (~50 MB for a 2,048-token
# step of model c). oneDNN gives each row the same bits in a product of any height from 7 rows
# up (measured on these shapes; one-row products differ); chunks have 256-511 rows.
_MLP_CHUNK_ROWS = 256


# A projection into the residual stream: (None, its output), or (the layer, its input) where
# the product is left to `_add_rms_norm`, which can run it together with the norm after it.
_Projection = tuple[nn.Module | None, torch.Tensor]


def _add_rms_norm(
    projection: _Projection, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += product` (in place) and its RMSNorm: for decode-sized batches one native
    call (PackedLinear.add_rms_norm), else the product then rms_norm_cpu."""
    layer, x = projection
    if layer is not None:
        if isinstance(layer, PackedLinear):
            fused = layer.add_rms_norm(x, residual, weight, eps)
            if fused is not None:
                return fused
        x = layer(x)
    return rms_norm_cpu(x, weight, eps, residual)


def _mlp(layer: LeanLayer, x: torch.Tensor) -> _Projection:
    """down(silu(gate(x)) * up(x)) for x [T, hidden], the down projection left to the caller;
    long inputs in row chunks, with it done."""
    num_tokens = x.shape[0]
    if num_tokens < 2 * _MLP_CHUNK_ROWS:
        return layer.down_proj, _activation(layer, x)
    chunks = num_tokens // _MLP_CHUNK_ROWS
    bounds = [num_tokens * i // chunks for i in range(chunks + 1)]
    out = torch.empty_like(x)
    for start, end in itertools.pairwise(bounds):
        out[start:end] = layer.down_proj(_activation(layer, x[start:end]))
    return None, out


def _activation(layer: LeanLayer, x: torch.Tensor) -> torch.Tensor:
    """silu(gate(x)) * up(x): the MLP's input to its down projection."""
    if layer.gate_up is not None:
        # Decode-sized batches: the product and its activation in one native call.
        fused = layer.gate_up.silu_mul(x) if isinstance(layer.gate_up, PackedLinear) else None
        if fused is not None:
            act = fused
        else:
            gate_up = layer.gate_up(x)  # [T, 2 * I]
            inter = gate_up.shape[-1] // 2
            act = silu_mul_cpu(gate_up[:, :inter], gate_up[:, inter:])
    else:
        assert layer.gate_proj is not None and layer.up_proj is not None
        act = silu_mul_cpu(layer.gate_proj(x), layer.up_proj(x))
    return act


def _project_qkv(
    layer: LeanLayer, x: torch.Tensor, num_tokens: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H_q, D], k and v [T, H_kv, D]: column views of one joint GEMM, or three GEMMs."""
    if layer.qkv is not None:
        qkv: torch.Tensor = layer.qkv(x)
        heads = qkv.view(num_tokens, -1, d)  # [T, H_q + 2 * H_kv, D]
        num_kv = layer.num_kv_heads
        num_q = heads.shape[1] - 2 * num_kv
        return heads[:, :num_q], heads[:, num_q : num_q + num_kv], heads[:, num_q + num_kv :]
    assert layer.q_proj is not None and layer.k_proj is not None and layer.v_proj is not None
    return (
        layer.q_proj(x).view(num_tokens, -1, d),
        layer.k_proj(x).view(num_tokens, -1, d),
        layer.v_proj(x).view(num_tokens, -1, d),
    )


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this forward can't run `model` (None: it can). The caller has checked that the
    native kernels are built (`loader.choose_model`)."""
    arch = type(model).__name__
    layer_cls = _ARCHITECTURES.get(arch)
    if layer_cls is None:
        return f"architecture {arch!r} is not one of {sorted(_ARCHITECTURES)}"
    base = getattr(model, "model", None)
    if base is None or not all(
        hasattr(base, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")
    ):
        return f"{arch}: unexpected module layout"
    if type(base.norm).__name__ not in _NORMS:
        return f"{arch}: final norm {type(base.norm).__name__}"
    for layer in base.layers:
        if type(layer).__name__ != layer_cls:
            return f"{arch}: layer class {type(layer).__name__}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [m for m in (getattr(layer.self_attn, n, None) for n in _HEAD_NORMS) if m]
        if any(type(m).__name__ not in _NORMS for m in norms):
            return f"{arch}: a norm of another kind"
        if type(getattr(layer.mlp, "act_fn", None)).__name__ not in _SILUS:
            return f"{arch}: an MLP activation other than SiLU"
    return None


def join_projections(model: nn.Module) -> int:
    """Give each layer one q/k/v and one gate/up projection where that changes no number.

    Call before the weights are packed, on a model `unsupported_reason` accepts. A joint
    projection is made only from plain `nn.Linear`s (with biases on all or none) and kept
    only where a probe gives bit for bit the separate projections' outputs. Returns how many
    joint projections were made; the model then runs through `CpuForward` only.
    """
    joined = 0
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _joint([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            attn.qkv_proj = qkv
            del attn.q_proj, attn.k_proj, attn.v_proj
            joined += 1
        gate_up = _joint([mlp.gate_proj, mlp.up_proj])
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
            del mlp.gate_proj, mlp.up_proj
            joined += 1
    return joined


_HEAD_NORMS = ("q_norm", "k_norm")


def _head_dim(model: nn.Module) -> int:
    attn = model.model.layers[0].self_attn  # type: ignore[union-attr,index]
    return int(attn.head_dim)


def _collect(layer: nn.Module, head_dim: int) -> LeanLayer:
    attn: Any = layer.self_attn
    mlp: Any = layer.mlp
    joint_qkv = getattr(attn, "qkv_proj", None)
    if joint_qkv is None:
        kv_features = attn.k_proj.out_features
    else:  # the joint projection is [q; k; v], and o_proj reads q's width back
        kv_features = (joint_qkv.out_features - attn.o_proj.in_features) // 2
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    input_norm: Any = layer.input_layernorm
    post_norm: Any = layer.post_attention_layernorm
    return LeanLayer(
        input_norm=input_norm.weight,
        post_norm=post_norm.weight,
        eps=float(input_norm.variance_epsilon),
        qkv=joint_qkv,
        q_proj=getattr(attn, "q_proj", None),
        k_proj=getattr(attn, "k_proj", None),
        v_proj=getattr(attn, "v_proj", None),
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        head_eps=float(q_norm.variance_epsilon) if q_norm is not None else 0.0,
        num_kv_heads=kv_features // head_dim,
        o_proj=attn.o_proj,
        gate_up=getattr(mlp, "gate_up_proj", None),
        gate_proj=getattr(mlp, "gate_proj", None),
        up_proj=getattr(mlp, "up_proj", None),
        down_proj=mlp.down_proj,
        scale=float(attn.scaling),
    )


def _joint(parts: list[nn.Module]) -> nn.Linear | None:
    """One linear layer computing `parts` side by side, if its outputs are theirs to the bit."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    linears: list[nn.Linear] = parts  # type: ignore[assignment]
    joint = joint_weights([p.weight for p in linears], [p.bias for p in linears])
    if joint is None:
        return None
    weight, bias = joint
    layer = nn.Linear(1, 1, bias=False, device="meta")  # no initialisation of the real size
    layer.in_features, layer.out_features = weight.shape[1], weight.shape[0]
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None  # type: ignore[assignment]
    return layer


def joint_weights(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weights (and biases) of one linear layer computing these side by side, if a probe
    shows its outputs are theirs to the bit; None otherwise.

    Only for bf16/fp16 weights, whose oneDNN GEMMs reduce over the input features in the same
    order whatever the output width: fp32 GEMMs (MKL) pick other kernels for other widths,
    and do give other last bits (seen on one-row products). A probe checks it anyway. Biases
    must be on all parts or none.
    """
    first = weights[0]
    has_bias = [b is not None for b in biases]
    if any(has_bias) != all(has_bias) or first.dtype not in (torch.bfloat16, torch.float16):
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = torch.cat([b.detach() for b in biases if b is not None]) if all(has_bias) else None
        # Which kernel a GEMM runs depends on its shapes and dtype, not on the numbers: one
        # probe per kind of layer (a model's layers are all alike) answers for the rest.
        key = (tuple(w.shape for w in weights), first.dtype, first.device, all(has_bias))
        if key not in _PROBED:
            _PROBED[key] = _same_bits(weight, bias, weights, biases)
        if not _PROBED[key]:
            return None
    return weight, bias


_PROBED: dict[tuple[Any, ...], bool] = {}


def _same_bits(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
) -> bool:
    g = torch.Generator(device=weight.device).manual_seed(0)
    for rows in (1, 3, 17, 64):  # GEMMs of other heights may block differently
        x = torch.randn(rows, weight.shape[1], generator=g, device=weight.device)
        x = x.to(weight.dtype)
        parts = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        if not torch.equal(F.linear(x, weight, bias), torch.cat(parts, dim=-1)):
            return False
    return True
