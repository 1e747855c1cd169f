"""Shard a loaded transformers model across tensor-parallel ranks, Megatron style.

Which linear layers split which way comes from the model's own TP plan
(`config.base_model_tp_plan`, e.g. `"layers.*.self_attn.q_proj": "colwise"`), or, for a
config without one, from DEFAULT_TP_PLAN (the usual q/k/v/o and gate/up/down names); the
sharding itself is ours, with plain tensors (no DTensor), so a forward pass is the model's own code:

- colwise (q/k/v, gate/up): each rank keeps a contiguous slice of the output features. For
  attention that is whole heads: rank r holds query heads [r*Hq/tp, (r+1)*Hq/tp) and the KV
  heads they read, since heads are laid out head-major in the projection.
- rowwise (o_proj, down_proj): each rank keeps the matching slice of the input features and
  the partial outputs are summed with an all-reduce; a bias is added once, after the sum.
- embeddings, norms and lm_head stay whole on every rank.

The attention modules reshape with `-1` heads, so they run with the local head count as is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from asyncengine.errors import UnsupportedModelError

AllReduce = Callable[[torch.Tensor], torch.Tensor]

_COLWISE = "colwise"
_ROWWISE = "rowwise"
_REPLICATED = ("replicated_with_grad_allreduce",)  # the same weights on every rank

# For models whose config carries no TP plan: the Llama family's projection names.
DEFAULT_TP_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": _COLWISE,
    "layers.*.self_attn.k_proj": _COLWISE,
    "layers.*.self_attn.v_proj": _COLWISE,
    "layers.*.self_attn.o_proj": _ROWWISE,
    "layers.*.mlp.gate_proj": _COLWISE,
    "layers.*.mlp.up_proj": _COLWISE,
    "layers.*.mlp.down_proj": _ROWWISE,
}


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features; sums partial outputs over ranks.

    The slice is a plain bias-free `nn.Linear` (`self.linear`), so whatever handles linear
    layers (the CPU weight packing) handles it too; the bias is added once, after the sum.
    """

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, all_reduce: AllReduce):
        super().__init__()
        in_per_rank = linear.in_features // world_size
        cols = slice(rank * in_per_rank, (rank + 1) * in_per_rank)
        self.linear = nn.Linear(
            in_per_rank, linear.out_features, bias=False, dtype=linear.weight.dtype,
            device=linear.weight.device,
        )  # fmt: skip
        self.linear.weight = nn.Parameter(
            linear.weight[:, cols].clone(memory_format=torch.contiguous_format), requires_grad=False
        )
        self.bias = linear.bias
        self.in_features = in_per_rank
        self.out_features = linear.out_features
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in/tp] → [..., out]
        out = self._all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


def shard_model(model: nn.Module, rank: int, world_size: int, all_reduce: AllReduce) -> None:
    """Shard `model` in place for `rank` of `world_size` per the model's TP plan.

    Uses `config.base_model_tp_plan`, or DEFAULT_TP_PLAN when the config has none. Raises
    UnsupportedModelError when the plan uses a sharding style we do not implement, or matches
    no layer.
    """
    config = model.config  # type: ignore[attr-defined]
    arch = type(model).__name__
    # The model's own plan where it has one; else ours, by the usual projection names.
    plan: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_TP_PLAN)
    base = model.get_submodule(getattr(model, "base_model_prefix", "model"))
    rules = [(_pattern(key), style, key) for key, style in plan.items()]
    sharded = 0
    for name, module in list(base.named_modules()):
        style = next((s for pattern, s, _ in rules if pattern.fullmatch(name)), None)
        if style is None or style in _REPLICATED:
            continue
        if style not in (_COLWISE, _ROWWISE) or not isinstance(module, nn.Linear):
            raise UnsupportedModelError(
                f"architecture {arch!r}: tensor parallelism does not support the sharding "
                f"{style!r} of {name!r} ({type(module).__name__}); supported: linear layers "
                f"split '{_COLWISE}' or '{_ROWWISE}'"
            )
        if style == _COLWISE:
            _shard_columns(module, rank, world_size)
        else:
            base.set_submodule(name, RowParallelLinear(module, rank, world_size, all_reduce))
        sharded += 1
    if sharded == 0:
        raise UnsupportedModelError(
            f"architecture {arch!r}: its TP plan matched no layer, so nothing was sharded"
        )


def _shard_columns(linear: nn.Linear, rank: int, world_size: int) -> None:
    out_per_rank = linear.out_features // world_size
    rows = slice(rank * out_per_rank, (rank + 1) * out_per_rank)
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = out_per_rank


def _pattern(plan_key: str) -> re.Pattern[str]:
    """`layers.*.mlp.up_proj` → a regex over module names, `*` being a layer index."""
    return re.compile(r"\d+".join(re.escape(part) for part in plan_key.split("*")))
