"""Rotary position embedding applied to queries and keys in place: the torch reference.

`cos_sin_cache` is `[max_position, rot_dim]`: the cosines of a position's `rot_dim / 2`
frequencies, then their sines. The first `rot_dim` dimensions of every head rotate (`rot_dim`
may be less than the head size: partial rotary); the rest are left alone. Pairs are
`(i, i + rot_dim / 2)` in the neox style (Llama, Qwen, Mistral in transformers) and
`(2i, 2i + 1)` in the GPT-J style; pair i turns by the angle of frequency i:
`(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`, computed in fp32.
"""

from __future__ import annotations

import torch


def rotary_embedding_torch(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H_q, D], rotated in place
    key: torch.Tensor | None,  # [T, H_kv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    is_neox: bool,
) -> None:
    """Torch reference: rotate the first rot_dim dimensions of every head, in place."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [T, rot_dim]
    cos = cos_sin[:, None, :half]  # [T, 1, rot_dim / 2]
    sin = cos_sin[:, None, half:]
    for x in (query, key):
        if x is None:
            continue
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:rot_dim]  # [T, H, rot_dim / 2] views
        else:
            x1, x2 = x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]
        x1f, x2f = x1.float(), x2.float()
        # Both results are computed before either view is overwritten.
        out1 = x1f * cos - x2f * sin
        out2 = x2f * cos + x1f * sin
        x1.copy_(out1)
        x2.copy_(out2)
