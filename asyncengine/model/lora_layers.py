"""LoRA on the lean CPU forward: an adapter's weights (`LoRAWeights`, loaded from a checked
PEFT folder) and one step's mixed batch of adapters (`LoRABatch`).

Each projection's base product runs once for every row, then each adapter's low-rank product
is added to its rows. `CpuForward`'s native decode call (`decode_layers.py`) does it in C
(`kernels/csrc/lora.c`), reading each adapter's `native_table`: per layer and group of
projections that read one input (q/k/v, o, gate/up, down), a descriptor of its stacked A and
its transposed, scaled B matrices, built at load so that the kernel reads contiguous memory.
Steps it does not take (prefills, fp32 models) run the Python loop, where `LoRABatch.add` adds
them: with the same native kernel for a bf16 model (`NATIVE_IN_LOOP`), else with the torch
reference (`kernels/lora.py`); where q/k/v (or gate/up) come from one joint GEMM, the deltas go
to the column views of each part. The down projection's long-prompt row chunks are not used
there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from asyncengine.kernels.cpu_native import load_native
from asyncengine.kernels.lora import (
    LORA_FIELDS,
    LORA_GROUPS,
    Rows,
    lora_add_native,
    lora_descriptor,
    lora_expand_add,
    lora_shrink,
)
from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu
from asyncengine.lora.peft_folder import PeftAdapter
from asyncengine.model.lean_layer import LeanLayer

# Projections that read the same input: their deltas shrink once, with A stacked.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}

# Whether the Python loop adds a bf16 model's deltas with the native kernel (benchmarks/lora.py's
# 1,024-row prefill, 4 adapters: 0.16-0.20 s against the torch reference's 0.46-0.49 s, side by
# side on 2 cores); tests turn it off to compare with the reference.
NATIVE_IN_LOOP = True

# A group of one layer, as an adapter has it: its stacked A [R, in], and per projection it
# adapts, (name, its rows of the shrink's output lo:hi, its B [out, hi - lo]).
Group = tuple[torch.Tensor, list[tuple[str, int, int, torch.Tensor]]]


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's tensors: (layer, module) -> (A [r, in], B [out, r] times the scale), and
    the same stacked by input (`group`). B is a transposed view of a contiguous B^T [r, out],
    the layout the native kernel reads."""

    name: str
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    _groups: dict[tuple[int, str], Group | None] = field(default_factory=dict, repr=False)
    # [layers, len(LORA_GROUPS), LORA_FIELDS] int64: csrc/lora.c's descriptors (build_native)
    native_table: torch.Tensor | None = field(default=None, repr=False)
    _native_weights: list[torch.Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, adapter: PeftAdapter, dtype: torch.dtype = torch.float32) -> LoRAWeights:
        """Read a checked folder's tensors (`lora.peft_folder.check_peft_folder`), in `dtype`
        (fp32 by default, whatever the model's: the low-rank products are small, and fp32
        GEMMs of these shapes are faster on the CPU than bf16 ones)."""
        modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        with safe_open(adapter.weights_file, framework="pt") as f:  # type: ignore[no-untyped-call]
            for m in adapter.modules:
                a = f.get_tensor(m.a_name).to(torch.float32)
                b = f.get_tensor(m.b_name).to(torch.float32) * m.scale
                modules[(m.layer, m.module)] = (
                    a.to(dtype).contiguous(),
                    b.to(dtype).t().contiguous().t(),
                )
        return cls(adapter.name, modules)

    def build_native(self, num_layers: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`native_table` for a model of `num_layers` layers: every group stacked now (the
        step then only reads addresses), zeros where the adapter adapts none of a group. The
        kernel reads the weights in `dtype` (fp32 or bf16: copies of the fp32 ones, half the
        memory traffic of a decode step; its sums are fp32 either way)."""
        rows: list[list[int]] = []
        keep: list[torch.Tensor] = []
        for layer in range(num_layers):
            for group in LORA_GROUPS:
                found = self.group(layer, group)
                if found is None:
                    rows.append([0] * LORA_FIELDS)
                    continue
                a, parts = found
                a = a.to(dtype)
                keep.append(a)
                by_module = {}
                for module, lo, _, b in parts:
                    keep.append(b.t().to(dtype).contiguous())
                    by_module[module] = (keep[-1], lo)
                rows.append(lora_descriptor(a, [by_module.get(m) for m in GROUPS[group]]))
        table = torch.tensor(rows, dtype=torch.int64).view(num_layers, len(LORA_GROUPS), -1)
        self.native_table, self._native_weights = table, keep
        return table

    def group(self, layer: int, group: str) -> Group | None:
        """The projections of `GROUPS[group]` this adapter adapts in `layer`, their A matrices
        stacked; None where it adapts none of them. Built once, on first use."""
        key = (layer, group)
        if key not in self._groups:
            found = [
                (m, self.modules[(layer, m)]) for m in GROUPS[group] if (layer, m) in self.modules
            ]
            parts, lo = [], 0
            for module, (a, b) in found:
                parts.append((module, lo, lo + a.shape[0], b))
                lo += a.shape[0]
            stacked = torch.cat([a for _, (a, _) in found]) if found else None
            self._groups[key] = None if stacked is None else (stacked, parts)
        return self._groups[key]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


@dataclass(slots=True)
class LoRABatch:
    """One step's adapters: each with the packed rows of its requests (kernels/lora.py's
    `Rows`: a slice where they are contiguous, else their indices)."""

    adapters: list[tuple[LoRAWeights, Rows]] = field(default_factory=list)
    _native: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )

    def native_segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step's segments as csrc/decode_layers.c takes them: int64 rows [M] (adapter by
        adapter), seg_rows [S + 1], and per adapter its `native_table`'s address; None where
        an adapter has no table. The tensors (and the tables) live as long as this batch."""
        if self._native is None:
            if any(w.native_table is None for w, _ in self.adapters):
                return None
            parts = [
                torch.arange(r.start, r.stop, dtype=torch.int64) if isinstance(r, slice) else r
                for _, r in self.adapters
            ]
            counts = [0, *(len(p) for p in parts)]
            self._native = (
                torch.cat(parts),
                torch.tensor(counts, dtype=torch.int64).cumsum(0),
                torch.tensor([w.native_table.data_ptr() for w, _ in self.adapters]),  # type: ignore[union-attr]
            )
        return self._native

    def add(self, layer: int, group: str, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        """Each adapter's deltas of the projections of `GROUPS[group]` in `layer`, added on its
        rows to their outputs `outs` (name -> [T, out], views are fine), from their common
        input `x` [T, in]; one shrink per adapter for the whole group."""
        if self._add_native(layer, group, x, outs):
            return
        for weights, rows in self.adapters:
            found = weights.group(layer, group)
            if found is None:
                continue
            a, parts = found
            shrunk = lora_shrink(x, rows, a)  # [N, R]
            for module, lo, hi, b in parts:
                lora_expand_add(outs[module], rows, shrunk[:, lo:hi], b)

    def _add_native(
        self, layer: int, group: str, x: torch.Tensor, outs: dict[str, torch.Tensor]
    ) -> bool:
        """`add` with csrc/lora.c, where it applies: a bf16 step whose outputs of the group
        are column views of one product (or one output); False, with nothing done, else."""
        if not NATIVE_IN_LOOP or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
            return False
        segments = self.native_segments()
        lib = load_native()
        parts = [outs[m] for m in GROUPS[group]]
        first = parts[0]
        if segments is None or lib is None or any(
            t.dtype != x.dtype or t.stride(-1) != 1 or t.stride(0) != first.stride(0)
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            for t in parts
        ):  # fmt: skip
            return False
        cols = [(t.data_ptr() - first.data_ptr()) // t.element_size() for t in parts]
        widths = [t.shape[-1] for t in parts]
        if any(c < 0 or c + w > first.stride(0) for c, w in zip(cols, widths, strict=True)):
            return False
        rows, seg_rows, tables = segments
        offset = (layer * len(LORA_GROUPS) + LORA_GROUPS.index(group)) * LORA_FIELDS
        lora_add_native(
            lib, first, x, list(zip(cols, widths, strict=True)), rows, seg_rows, tables, offset
        )
        return True

    def project(self, layer: int, module: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`linear(x)` plus the deltas (o_proj, down_proj): [T, out]."""
        out: torch.Tensor = linear(x)
        self.add(layer, module, x, {module: out})
        return out

    def add_qkv(
        self,
        layer: int,
        x: torch.Tensor,  # [T, hidden]
        q: torch.Tensor,  # [T, H_q, D], possibly column views of one joint product
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
    ) -> None:
        """The deltas of q/k/v_proj, into q, k and v in place (before the rotary)."""
        num_tokens = x.shape[0]
        outs = {"q_proj": q, "k_proj": k, "v_proj": v}
        self.add(layer, "qkv", x, {m: t.view(num_tokens, -1) for m, t in outs.items()})

    def mlp(self, index: int, layer: LeanLayer, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) with every projection's deltas: [T, hidden]."""
        if layer.gate_up is not None:
            gate_up = layer.gate_up(x)  # [T, 2 * I]
            inter = gate_up.shape[-1] // 2
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        else:
            assert layer.gate_proj is not None and layer.up_proj is not None
            gate, up = layer.gate_proj(x), layer.up_proj(x)
        self.add(index, "gate_up", x, {"gate_proj": gate, "up_proj": up})
        return self.project(index, "down_proj", layer.down_proj, silu_mul_cpu(gate, up))
