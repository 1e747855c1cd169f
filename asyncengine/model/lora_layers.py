"""LoRA on the lean CPU forward: an adapter's weights (`LoRAWeights`, loaded from a checked
PEFT folder) and one step's mixed batch of adapters (`LoRABatch`).

`CpuForward` runs a step whose rows use adapters through its Python layer loop (the fused
native decode call, `decode_layers.py`, has no LoRA): each projection's base product runs
once for every row, then `LoRABatch.add` adds each adapter's low-rank product to its rows
(`kernels/lora.py`). Where q/k/v (or gate/up) come from one joint GEMM, the deltas go to the
column views of each part. The down projection's long-prompt row chunks are not used here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from asyncengine.kernels.lora import Rows, lora_expand_add, lora_shrink
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

# A group of one layer, as an adapter has it: its stacked A [R, in], and per projection it
# adapts, (name, its rows of the shrink's output lo:hi, its B [out, hi - lo]).
Group = tuple[torch.Tensor, list[tuple[str, int, int, torch.Tensor]]]


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's tensors: (layer, module) -> (A [r, in], B [out, r] times the scale), and
    the same stacked by input (`group`)."""

    name: str
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    _groups: dict[tuple[int, str], Group | None] = field(default_factory=dict, repr=False)

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
                    b.to(dtype).contiguous(),
                )
        return cls(adapter.name, modules)

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

    def add(self, layer: int, group: str, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        """Each adapter's deltas of the projections of `GROUPS[group]` in `layer`, added on its
        rows to their outputs `outs` (name -> [T, out], views are fine), from their common
        input `x` [T, in]; one shrink per adapter for the whole group."""
        for weights, rows in self.adapters:
            found = weights.group(layer, group)
            if found is None:
                continue
            a, parts = found
            shrunk = lora_shrink(x, rows, a)  # [N, R]
            for module, lo, hi, b in parts:
                lora_expand_add(outs[module], rows, shrunk[:, lo:hi], b)

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
