"""ModelForward: the one interface between the model runner and a model.

Two implementations, each in its own module: `TransformersModel` (a transformers model with
paged attention plugged in; `model/transformers_model.py`) and `CpuForward` (the lean CPU
forward of the Llama family; `model/cpu_forward.py`). `model/loader.py` chooses between them,
once, and loads the chosen one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncengine.model.attention import AttentionMetadata


class ModelForward(Protocol):
    """One forward pass over a packed batch: every scheduled token of every request in one
    sequence, with its position.

    The runner guarantees: `input_ids` and `positions` are int64 on the model's device, one
    entry per token; `attn` holds this step's KV cache writes and attention plan for those
    tokens (built by `AttentionMetadata.build` for the model's backend); `logits_indices`
    names the packed rows whose logits are wanted, in order (possibly none). The model writes
    every token's K/V into the paged cache and returns the logits of those rows only, in the
    model's dtype, the vocabulary possibly padded past the tokenizer's.

    With `argmax_vocab` (the runner passes it when every row is sampled greedily with nothing
    that changes the logits first), a model may return the rows' tokens instead of their
    logits: [S] int64, each row's argmax over its first `argmax_vocab` logits, first index on
    ties, exactly the argmax of the logits it would have returned (CpuForward does, through
    an int8 screen of its lm_head).
    """

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
        argmax_vocab: int | None = None,
    ) -> torch.Tensor:  # [S, V] logits, or [S] int64 token ids
        ...
