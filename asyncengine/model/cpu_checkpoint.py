"""Build the lean CPU forward straight from a safetensors checkpoint, without transformers.

Importing transformers' model code takes about 1.3 s and 240 MB of resident memory in the
engine process. Loading through `from_pretrained` leaves another ~250 MB of freed-but-kept
heap behind. The lean forward (`cpu_forward.py`) does not need either, because it only runs
on the weights. So for the checkpoints it can read, this module reads config.json and the
safetensors files itself:

- Llama, Mistral, Qwen2 and Qwen3;
- SiLU MLPs and the rope types in `rope.py`;
- one `model.safetensors`, or shards listed in `model.safetensors.index.json`;
- on the "cpu" attention backend, without tensor parallelism.

It casts each tensor to the engine's dtype, joins and packs the projections layer by layer,
and returns the malloc arena's free pages to the system at the end. The numbers stay the
same as transformers' path: the same casts, the same GEMMs, the same rotary tables
(tests/model/test_cpu_checkpoint.py). Everything else loads through transformers as before:
`lean_checkpoint_reason` says why a checkpoint is not taken.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncengine.config import ModelConfig
from asyncengine.gguf.serving import is_gguf_file
from asyncengine.heap import libc_function, release_free_heap
from asyncengine.model.cpu_forward import CpuForward, joint_weights
from asyncengine.model.cpu_linear import PackedLinear, linear_layer, packs
from asyncengine.model.lean_layer import LeanLayer
from asyncengine.model.quant_linear import int8_linear
from asyncengine.model.rope import RopeSpec, RotaryEmbedding
from asyncengine.model.weight_arena import WeightArena

logger = logging.getLogger(__name__)

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DEFAULT_EPS = 1e-6  # every one of the four configs' rms_norm_eps default


def lean_checkpoint_reason(model_config: ModelConfig) -> str | None:
    """Why `load_cpu_forward` cannot build this model (None: it can).

    Reads config.json and the safetensors headers only: no tensor data, no torch ops.
    A GGUF file: `gguf_checkpoint.gguf_reason` (its header only).
    """
    if is_gguf_file(model_config.model):
        from asyncengine.model.gguf_checkpoint import gguf_reason

        return gguf_reason(model_config)
    try:
        _Plan.make(model_config)
    except _NotLean as exc:
        return str(exc)
    return None


def load_cpu_forward(model_config: ModelConfig) -> CpuForward:
    """The lean forward over the checkpoint's weights, in `model_config.dtype`, on the CPU.

    ValueError when `lean_checkpoint_reason` gives a reason.
    """
    if is_gguf_file(model_config.model):
        from asyncengine.model.gguf_checkpoint import load_gguf_forward

        return load_gguf_forward(model_config)
    try:
        plan = _Plan.make(model_config)
    except _NotLean as exc:
        raise ValueError(f"the lean CPU loader cannot read {model_config.model}: {exc}") from None
    dtype: torch.dtype = getattr(torch, model_config.dtype)
    with _open_tensors(plan.files) as tensors:
        read = tensors.read
        # safetensors' tensors view the file's mapping, which stays mapped (and resident) as
        # long as any of them lives. In bf16/fp16 every tensor kept is a copy, so that the
        # mapping goes: the packed projections are copies anyway (`get` reads them), and
        # without packing (a CPU whose oneDNN lacks the dtype) so is every weight. In fp32
        # nothing is copied (or joined): the weights stay views of the mapping, at
        # transformers' addresses, because MKL's fp32 GEMMs give other last bits for weights
        # at other alignments.
        copy_kept = dtype != torch.float32
        copy_all = copy_kept and not packs(dtype)

        def get(name: str) -> torch.Tensor:
            return read(name).to(dtype, copy=copy_all).contiguous()

        def keep(name: str) -> torch.Tensor:
            return read(name).to(dtype, copy=copy_kept).contiguous()

        expected = set(plan.expected_names(model_config.num_layers))

        def maybe(name: str) -> torch.Tensor | None:  # a bias or head norm the model has
            return keep(name) if name in expected else None

        # the weights the products read, side by side (model/weight_arena.py)
        arena = WeightArena()
        make: Any = functools.partial(linear_layer, arena=arena)
        if model_config.quantization == "int8":
            make = functools.partial(_int8_layer, arena=arena)
        layers = []
        for i in range(model_config.num_layers):
            layers.append(_load_layer(plan, i, get, keep, maybe, make))
            if copy_kept:  # the layer holds copies only: its pages of the file can go
                tensors.release()
            # and so can the heap the layer's temporaries (joined weights before packing)
            # held: malloc keeps them otherwise, and the load would peak at twice its size.
            release_free_heap()
        embed_name = "model.embed_tokens.weight"
        table = get(embed_name) if plan.tied else None  # a view of the file where get packs
        lm_head = linear_layer(get("lm_head.weight") if table is None else table, None, arena)
        native = lm_head.native if isinstance(lm_head, PackedLinear) else None
        # A tied lookup gathers from the lm_head's packed copy where it can (no plain copy
        # of the table: 272 MB at Qwen2.5-0.5B's shapes). Else it reads a plain table:
        # `table` itself where that is what keep() gives (a copy; fp32's view), or keep()'s.
        embed_rows = native.rows if table is not None and native is not None else None
        embed_weight = None
        if embed_rows is None:
            reuse = table is not None and copy_all == copy_kept
            embed_weight = table if reuse else keep(embed_name)
        del table
        if copy_kept:
            tensors.release()
        forward = CpuForward(
            embed_weight=embed_weight,
            embed_rows=embed_rows,
            rotary=RotaryEmbedding(plan.rope),
            final_norm=keep("model.norm.weight"),
            final_eps=plan.eps,
            lm_head=lm_head,
            head_dim=model_config.head_dim,
            layers=layers,
        )
    release_free_heap()
    return forward


class _NotLean(Exception):
    """Raised (and caught) while planning: the checkpoint is not one the loader takes."""


class _Plan:
    """What `load_cpu_forward` will read: tensor names to files, and the model's settings."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        self.rope: RopeSpec
        self.eps = _DEFAULT_EPS
        self.tied = False
        self.qkv_bias = self.o_bias = self.mlp_bias = self.head_norms = False
        self.num_kv_heads = 0

    @classmethod
    def make(cls, mc: ModelConfig) -> _Plan:
        if mc.attention_backend != "cpu":
            raise _NotLean(f"attention backend {mc.attention_backend!r}, not 'cpu'")
        if mc.architecture not in _ARCHITECTURES:
            raise _NotLean(f"architecture {mc.architecture!r} is not one of {_ARCHITECTURES}")
        model_dir = Path(mc.model)
        hf: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
        if "text_config" in hf:
            raise _NotLean("a nested text_config")
        if "transformers_weights" in hf:
            raise _NotLean("a weights file named in config.json")
        if "quantization_config" in hf:
            raise _NotLean("a quantized checkpoint")
        if hf.get("hidden_act", "silu") != "silu":
            raise _NotLean(f"hidden_act {hf.get('hidden_act')!r}, not 'silu'")
        plan = cls()
        try:
            plan.rope = RopeSpec.from_hf_config(hf, mc.head_dim)
        except ValueError as exc:
            raise _NotLean(str(exc)) from None
        plan.eps = float(hf.get("rms_norm_eps", _DEFAULT_EPS))
        plan.tied = bool(hf.get("tie_word_embeddings", False))
        arch = mc.architecture
        attention_bias = bool(hf.get("attention_bias", False))
        plan.qkv_bias = arch == "Qwen2ForCausalLM" or (
            attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        )
        plan.o_bias = attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        plan.mlp_bias = arch == "LlamaForCausalLM" and bool(hf.get("mlp_bias", False))
        plan.head_norms = arch == "Qwen3ForCausalLM"
        plan.num_kv_heads = mc.num_kv_heads
        plan.files = _tensor_files(model_dir)
        missing = [name for name in plan.expected_names(mc.num_layers) if name not in plan.files]
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise _NotLean(f"the checkpoint lacks {len(missing)} tensors ({shown})")
        _check_shapes(mc, plan.files)
        return plan

    def expected_names(self, num_layers: int) -> Iterator[str]:
        yield from ("model.embed_tokens.weight", "model.norm.weight")
        if not self.tied:
            yield "lm_head.weight"
        for i in range(num_layers):
            p = f"model.layers.{i}."
            yield from (p + "input_layernorm.weight", p + "post_attention_layernorm.weight")
            for proj, bias in (("q", self.qkv_bias), ("k", self.qkv_bias), ("v", self.qkv_bias),
                               ("o", self.o_bias)):  # fmt: skip
                yield p + f"self_attn.{proj}_proj.weight"
                if bias:
                    yield p + f"self_attn.{proj}_proj.bias"
            if self.head_norms:
                yield from (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
            for proj in ("gate", "up", "down"):
                yield p + f"mlp.{proj}_proj.weight"
                if self.mlp_bias:
                    yield p + f"mlp.{proj}_proj.bias"


_FLOAT_DTYPES = ("F32", "BF16", "F16")


def _check_shapes(mc: ModelConfig, files: dict[str, Path]) -> None:
    """The first layer's projections and the embedding have the shapes and float dtypes that
    config.json implies (read from the headers): a head_dim or head count that config.json
    gets wrong, or packed/quantised tensors, are left to transformers."""
    from safetensors import safe_open

    hidden, d = mc.hidden_size, mc.head_dim
    attn = "model.layers.0.self_attn."
    expected = {
        "model.embed_tokens.weight": [mc.vocab_size, hidden],
        attn + "q_proj.weight": [mc.num_attention_heads * d, hidden],
        attn + "k_proj.weight": [mc.num_kv_heads * d, hidden],
        attn + "v_proj.weight": [mc.num_kv_heads * d, hidden],
        attn + "o_proj.weight": [hidden, mc.num_attention_heads * d],
    }
    for name, shape in expected.items():
        with safe_open(files[name], framework="pt") as f:  # type: ignore[no-untyped-call]
            tensor = f.get_slice(name)
            got, dtype = tensor.get_shape(), tensor.get_dtype()
        rows_ok = got[0] >= shape[0] if name.startswith("model.embed") else got[0] == shape[0]
        if len(got) != 2 or not rows_ok or got[1] != shape[1] or dtype not in _FLOAT_DTYPES:
            raise _NotLean(f"{name} is {dtype} {got}, config.json implies {shape}")


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the headers only."""
    from safetensors import safe_open

    # transformers' order: the single file first, then the shards' index.
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        with safe_open(single, framework="pt") as f:  # type: ignore[no-untyped-call]
            return dict.fromkeys(f.keys(), single)
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    raise _NotLean("no model.safetensors or model.safetensors.index.json")


class _Tensors:
    """`read(name) -> tensor` over safetensors files, each opened (mapped) once.

    The tensors view the files' mappings, and every page read stays resident (counted in the
    process's memory) while the file is mapped: loading a bf16 checkpoint then peaks at the
    file plus its copies (~2.6 GB for a 0.5B model against 1.5 after). `release()` drops the
    pages of what was read so far from this process (MADV_DONTNEED: they are the file's, and
    would be read again from it if touched), for callers that keep only copies.
    """

    _MADV_DONTNEED = 4
    _PAGE = 4096

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self._files, self._stack = files, stack
        self._handles: dict[Path, Any] = {}
        self._mapped: list[tuple[int, int]] = []  # the files' mappings' address ranges
        self._read: list[tuple[int, int]] = []  # (address, bytes) of the views handed out

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))  # type: ignore[no-untyped-call]
            # /proc/self/maps names files by their resolved paths
            self._mapped = _mappings({os.path.realpath(p) for p in self._handles})
        tensor: torch.Tensor = self._handles[path].get_tensor(name)
        self._read.append((tensor.data_ptr(), tensor.nbytes))
        return tensor

    def release(self) -> None:
        """Drop the read tensors' pages that lie inside a mapping of one of the files."""
        read, self._read = self._read, []
        madvise = libc_function("madvise")
        if madvise is None:
            return
        for address, size in read:
            start = address & ~(self._PAGE - 1)
            end = address + size
            if any(lo <= start and end <= hi for lo, hi in self._mapped):
                madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), self._MADV_DONTNEED)


def _mappings(paths: set[str]) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `paths` (/proc/self/maps; none
    elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() in paths:
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


@contextmanager
def _open_tensors(files: dict[str, Path]) -> Iterator[_Tensors]:
    """The checkpoint's tensors (`_Tensors`); the files are unmapped when the block ends."""
    with ExitStack() as stack:
        yield _Tensors(files, stack)


def _int8_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, arena: WeightArena
) -> torch.nn.Module:
    """`quantization="int8"`: the projection quantized per output channel (int8_linear, its
    blocks in the load's `arena`), or as it is where its K is not a multiple of 32."""
    return int8_linear(weight, bias, arena) or linear_layer(weight, bias, arena)


def _load_layer(
    plan: _Plan, i: int, get: Any, keep: Any, maybe: Any, make: Any = linear_layer
) -> LeanLayer:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    names = [attn + f"{x}_proj" for x in "qkv"]
    qkv_w = [get(n + ".weight") for n in names]
    qkv_b = [maybe(n + ".bias") for n in names]
    joint = joint_weights(qkv_w, qkv_b)
    q_proj = k_proj = v_proj = qkv = None
    if joint is not None:
        qkv = make(*joint)
    else:
        q_proj, k_proj, v_proj = (make(w, b) for w, b in zip(qkv_w, qkv_b, strict=True))
    del qkv_w, qkv_b, joint  # the joint copy replaces them: free them before the next layer
    gate_w, up_w = get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")
    gate_b, up_b = maybe(mlp + "gate_proj.bias"), maybe(mlp + "up_proj.bias")
    joint = joint_weights([gate_w, up_w], [gate_b, up_b])
    gate_proj = up_proj = gate_up = None
    if joint is not None:
        gate_up = make(*joint)
    else:
        gate_proj, up_proj = make(gate_w, gate_b), make(up_w, up_b)
    del gate_w, up_w, joint
    head_dim = plan.rope.head_dim
    return LeanLayer(
        input_norm=keep(p + "input_layernorm.weight"),
        post_norm=keep(p + "post_attention_layernorm.weight"),
        eps=plan.eps,
        qkv=qkv,
        q_proj=q_proj,
        k_proj=k_proj,
        v_proj=v_proj,
        q_norm=maybe(attn + "q_norm.weight"),
        k_norm=maybe(attn + "k_norm.weight"),
        head_eps=plan.eps,
        num_kv_heads=plan.num_kv_heads,
        o_proj=make(get(attn + "o_proj.weight"), maybe(attn + "o_proj.bias")),
        gate_up=gate_up,
        gate_proj=gate_proj,
        up_proj=up_proj,
        down_proj=make(get(mlp + "down_proj.weight"), maybe(mlp + "down_proj.bias")),
        scale=head_dim**-0.5,
    )
