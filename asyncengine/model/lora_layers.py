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

from asyncengine.kernels.lora import lora_add_segments
from asyncengine.kernels.silu_mul_cpu import silu_mul_cpu
from asyncengine.lora.peft_folder import PeftAdapter
from asyncengine.model.lean_layer import LeanLayer


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's tensors: (layer, module) -> (A [r, in], B [out, r] times the scale)."""

    name: str
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, adapter: PeftAdapter, dtype: torch.dtype) -> LoRAWeights:
        """Read a checked folder's tensors (`lora.peft_folder.check_peft_folder`), in `dtype`."""
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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


@dataclass(slots=True)
class LoRABatch:
    """One step's adapters: each with the packed rows [N] (int64) of its requests."""

    adapters: list[tuple[LoRAWeights, torch.Tensor]] = field(default_factory=list)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` [T, out] (a view is fine) += each adapter's delta for (layer, module) on its
        rows of `x` [T, in]; adapters that do not adapt this projection add nothing."""
        segments = []
        for weights, rows in self.adapters:
            ab = weights.modules.get((layer, module))
            if ab is not None:
                segments.append((rows, ab[0], ab[1]))
        if segments:
            lora_add_segments(out, x, segments)

    def project(self, layer: int, module: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`linear(x)` plus the deltas: [T, out]."""
        out: torch.Tensor = linear(x)
        self.add(layer, module, x, out)
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
        for module, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            self.add(layer, module, x, part.view(num_tokens, -1))

    def mlp(self, index: int, layer: LeanLayer, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) with every projection's deltas: [T, hidden]."""
        if layer.gate_up is not None:
            gate_up = layer.gate_up(x)  # [T, 2 * I]
            inter = gate_up.shape[-1] // 2
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        else:
            assert layer.gate_proj is not None and layer.up_proj is not None
            gate, up = layer.gate_proj(x), layer.up_proj(x)
        self.add(index, "gate_proj", x, gate)
        self.add(index, "up_proj", x, up)
        return self.project(index, "down_proj", layer.down_proj, silu_mul_cpu(gate, up))
