"""The low-rank add on a step's packed rows (kernels/lora.py, model/lora_layers.py): each
adapter's rows get `x @ A^T @ B^T` (B scaled), other rows nothing, also into the column views
of a joint q/k/v product."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.lora import lora_add_segments
from asyncengine.model.lora_layers import LoRABatch, LoRAWeights

pytestmark = pytest.mark.timeout(60)


def test_segments_add_each_adapters_product_to_its_rows_only() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g)
    base = torch.randn(7, 24, generator=g)
    a1, b1 = torch.randn(4, 16, generator=g), torch.randn(24, 4, generator=g)
    a2, b2 = torch.randn(2, 16, generator=g), torch.randn(24, 2, generator=g)
    rows1, rows2 = torch.tensor([0, 1, 5]), slice(3, 5)  # indices, and a contiguous span
    out = base.clone()
    lora_add_segments(out, x, [(rows1, a1, b1), (rows2, a2, b2)])
    expected = base.clone()
    expected[rows1] += x[rows1] @ (b1 @ a1).t()
    expected[rows2] += x[rows2] @ (b2 @ a2).t()
    torch.testing.assert_close(out, expected)
    untouched = [2, 6]
    assert torch.equal(out[untouched], base[untouched])


def test_qkv_deltas_go_into_the_column_views_of_a_joint_product() -> None:
    g = torch.Generator().manual_seed(1)
    tokens, hidden, heads, kv_heads, d = 5, 16, 4, 2, 4
    x = torch.randn(tokens, hidden, generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    joint = qkv.clone().view(tokens, -1, d)
    q, k, v = joint[:, :heads], joint[:, heads : heads + kv_heads], joint[:, heads + kv_heads :]
    # q and v adapted (their A stacked into one shrink), k not.
    a_q, b_q = torch.randn(3, hidden, generator=g), torch.randn(heads * d, 3, generator=g)
    a_v, b_v = torch.randn(2, hidden, generator=g), torch.randn(kv_heads * d, 2, generator=g)
    weights = LoRAWeights("qv", {(0, "q_proj"): (a_q, b_q), (0, "v_proj"): (a_v, b_v)})
    rows = torch.tensor([1, 3])
    LoRABatch([(weights, rows)]).add_qkv(0, x, q, k, v)
    q_width, kv_width = heads * d, kv_heads * d
    expected = qkv.clone()
    expected[rows, :q_width] += x[rows] @ a_q.t() @ b_q.t()
    expected[rows, q_width + kv_width :] += x[rows] @ a_v.t() @ b_v.t()
    torch.testing.assert_close(joint.view(tokens, -1), expected)
    assert torch.equal(joint.view(tokens, -1)[:, q_width : q_width + kv_width],
                       qkv[:, q_width : q_width + kv_width])  # fmt: skip
