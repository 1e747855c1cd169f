"""The lean CPU forward's decoder layers in one native call (`kernels/csrc/decode_layers.c`).

A decode step is six to nine kernel calls a layer. Made from Python, each call costs more
interpreter, ctypes and allocation time than a one-row norm or activation takes (about 8 ms of
a 25 ms SmolLM2 step on 2 Zen 3 cores). `NativeDecodeLayers` runs the same kernels in the same
order from C, on buffers allocated once per step, so its numbers are `CpuForward`'s Python
loop's to the bit.

It applies to a bf16 model whose every projection runs on a native kernel: `NativeDenseLinear`
(CPUs without AVX512-BF16), a `PackedLinear` whose product the native kernels take
(`PackedLinear.native`, AVX512-BF16 CPUs) or a `QuantLinear` of a format the native quantized
kernels run (GGUF files, `quantization="int8"`), in any mix, with one eps, head-norm eps and
attention scale across its layers; and to a step with no prefill chunk long enough for SDPA
and fewer tokens than MAX_TOKENS and than the packed layers' `native_max_rows` allows (4 on
CPUs with AMX, where oneDNN's tile kernels take more rows). `CpuForward` runs its Python loop
otherwise.

A step whose rows use LoRA adapters stays on this call: each adapter's `native_table`
(model/lora_layers.py) goes in with its rows, and after each group of products the C code adds
their low-rank deltas (kernels/csrc/lora.c), as the Python loop adds them after its products.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.cpu_native import NativeKernels, load_native
from asyncengine.kernels.decode_layers_cpu import LAYER_FIELDS, decode_layers_bf16, quant_kp
from asyncengine.kernels.paged_attention_cpu import CpuAttentionPlan
from asyncengine.kernels.quant_formats import quant_format
from asyncengine.model.attention import AttentionMetadata
from asyncengine.model.cpu_linear import NativeDenseLinear, PackedLinear
from asyncengine.model.lean_layer import LeanLayer
from asyncengine.model.lora_layers import LoRABatch
from asyncengine.model.quant_linear import QuantLinear

_FIELD = {name: i for i, name in enumerate(LAYER_FIELDS)}
# Longer steps (prefills) run the Python loop: there the kernels' own time dwarfs the calls'
# (a 128-token SmolLM2 step is ~27 GFLOP of products, ~0.2 s on 2 Zen 3 cores, against the
# ~8 ms of Python calls that one native call saves).
MAX_TOKENS = 128


class NativeDecodeLayers:
    """A model's decoder layers as one native call per step; see the module docstring."""

    def __init__(
        self,
        lib: NativeKernels,
        table: torch.Tensor,  # [L, len(LAYER_FIELDS)] int64 addresses, kv_cache filled per step
        keep: list[object],  # what `table` points into
        dims: tuple[int, int, int, int, int],  # hidden, H_q, H_kv, D, intermediate
        eps: float,
        head_eps: float,
        scale: float,
        max_tokens: int,  # the most tokens of a step it runs
    ) -> None:
        self._lib = lib
        self._table = table
        self._keep = keep
        self.max_tokens = max_tokens
        self._dims = dims
        self._eps, self._head_eps, self._scale = eps, head_eps, scale
        self._cache_addresses: tuple[int, ...] = ()  # the KV caches `table` points at

    @classmethod
    def build(cls, layers: list[LeanLayer], head_dim: int) -> NativeDecodeLayers | None:
        """For `CpuForward`'s LeanLayers; None where the model is not one this runs."""
        lib = load_native()
        if lib is None or not layers:
            return None
        first = layers[0]
        if any(
            (layer.eps, layer.head_eps, layer.scale) != (first.eps, first.head_eps, first.scale)
            for layer in layers
        ):
            return None
        rows: list[list[int]] = []
        keep: list[object] = []
        dims: set[tuple[int, int, int, int, int]] = set()
        row_limits = [MAX_TOKENS - 1]  # the most tokens of a step it runs, and the layers' own
        for layer in layers:
            row = _layer_row(layer, head_dim, keep, row_limits)
            if row is None:
                return None
            fields, layer_dims = row
            rows.append(fields)
            dims.add(layer_dims)
        if len(dims) != 1:
            return None
        table = torch.tensor(rows, dtype=torch.int64)
        return cls(
            lib, table, keep, dims.pop(), first.eps, first.head_eps, first.scale,
            min(row_limits),
        )  # fmt: skip

    def __call__(
        self,
        residual: torch.Tensor,  # [T, hidden] bf16, updated in place
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor | None:
        """The last layer's MLP output [T, hidden] (not yet added to `residual`), after the
        layers ran on `residual`, with `lora`'s adapters' deltas on their rows; None, with
        nothing done, where this step is not one it runs (the caller then runs its Python
        loop)."""
        num_tokens = residual.shape[0]
        plan, caches = attn.plan, attn.kv_caches
        if not isinstance(plan, CpuAttentionPlan) or plan.prefills:
            return None
        if not 0 < num_tokens <= self.max_tokens:
            return None
        if residual.dtype != torch.bfloat16 or not residual.is_contiguous():
            return None
        addresses = tuple(c.data_ptr() for c in caches)
        if addresses != self._cache_addresses:  # checked and written once per set of caches
            if len(caches) != self._table.shape[0] or any(
                c.dtype != torch.bfloat16 or not c.is_contiguous() for c in caches
            ):
                return None
            self._table[:, _FIELD["kv_cache"]] = torch.tensor(addresses)
            self._cache_addresses = addresses
        segments = None
        if lora is not None:
            segments = lora.native_segments()
            if segments is None or any(
                w.native_table is None or w.native_table.shape[0] != len(caches)
                for w, _ in lora.adapters
            ):
                return None
        return decode_layers_bf16(
            self._lib, self._table, self._dims, residual,
            cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous(),
            attn.slot_mapping.to(torch.int64).contiguous(), tuple(caches[0].shape), plan,
            self._eps, self._head_eps, self._scale, segments,
        )  # fmt: skip


def _layer_row(
    layer: LeanLayer, head_dim: int, keep: list[object], row_limits: list[int]
) -> tuple[list[int], tuple[int, int, int, int, int]] | None:
    """One layer's row of addresses and its dims; None where a part is not one it runs. The
    packed projections' `native_max_rows` go into `row_limits`."""
    fields = [0] * len(LAYER_FIELDS)

    def put(name: str, tensor: torch.Tensor | None) -> bool:
        if tensor is None:
            return True
        if tensor.dtype != torch.bfloat16 or not tensor.is_contiguous():
            return False
        keep.append(tensor)
        fields[_FIELD[name]] = tensor.data_ptr()
        return True

    def put_linear(prefix: str, module: object, in_features: int) -> int | None:
        """The layer's weight, bias and packed extent; its output width, None where no
        native kernel takes it or it does not read `in_features` values."""
        if type(module) is NativeDenseLinear:
            if module.in_features != in_features:
                return None
            if not (put(f"{prefix}_w", module.packed) and put(f"{prefix}_b", module.bias)):
                return None
            return int(module.out_features)
        if type(module) is QuantLinear:
            return _put_quant(module, in_features, prefix, fields, keep, row_limits)
        if type(module) is not PackedLinear or module.in_features != in_features:
            return None
        native = module.native  # None unless bf16 weight and bias on the AVX512-BF16 build
        if native is None:
            return None
        keep.append(native)
        fields[_FIELD[f"{prefix}_w"]] = native.address
        fields[_FIELD[f"{prefix}_b"]] = native.bias_address
        fields[_FIELD[f"{prefix}_kp"]] = native.packed_k
        row_limits.append(module.native_max_rows)
        return int(module.out_features)

    if not (put("in_norm", layer.input_norm) and put("post_norm", layer.post_norm)):
        return None
    if not (put("q_norm", layer.q_norm) and put("k_norm", layer.k_norm)):
        return None
    hidden = int(layer.input_norm.shape[0])
    hkv = int(layer.num_kv_heads)
    if layer.qkv is not None:
        width = put_linear("q", layer.qkv, hidden)
        if width is None:
            return None
        hq = width // head_dim - 2 * hkv
    else:
        widths = [put_linear(n, getattr(layer, f"{n}_proj"), hidden) for n in ("q", "k", "v")]
        if None in widths or widths[1] != hkv * head_dim or widths[2] != hkv * head_dim:
            return None
        hq = int(widths[0]) // head_dim  # type: ignore[arg-type]
    if hq <= 0 or put_linear("o", layer.o_proj, hq * head_dim) != hidden:
        return None
    if layer.gate_up is not None:
        width = put_linear("gate", layer.gate_up, hidden)
        if width is None:
            return None
        inter = width // 2
    else:
        gate = put_linear("gate", layer.gate_proj, hidden)
        up = put_linear("up", layer.up_proj, hidden)
        if gate is None or gate != up:
            return None
        inter = gate
    if put_linear("down", layer.down_proj, inter) != hidden or hq % hkv:
        return None
    return fields, (hidden, hq, hkv, head_dim, inter)


def _put_quant(
    module: QuantLinear,
    in_features: int,
    prefix: str,
    fields: list[int],
    keep: list[object],
    row_limits: list[int],
) -> int | None:
    """A QuantLinear's row fields (its blocks, a bf16 copy of its bias, its format as "*_kp");
    its output width, None where the native kernels do not run its format."""
    if not module.native or module.in_features != in_features:
        return None
    weight = module.qweight
    if not weight.is_contiguous():
        return None
    keep.append(weight)
    fields[_FIELD[f"{prefix}_w"]] = weight.data_ptr()
    if module.bias is not None:
        bias = module.bias.to(torch.bfloat16).contiguous()
        keep.append(bias)
        fields[_FIELD[f"{prefix}_b"]] = bias.data_ptr()
    fields[_FIELD[f"{prefix}_kp"]] = quant_kp(quant_format(module.qtype).code)
    if module.dequant:  # more rows run the Python loop, where it dequantizes for the GEMM
        row_limits.append(module.dequant_min_rows - 1)
    return int(module.out_features)
