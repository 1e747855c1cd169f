"""ModelForward: the one interface between the model runner and a model.

Two implementations, each in its own module: `TransformersModel` (a transformers model with
paged attention plugged in; `model/transformers_model.py`) and `CpuForward` (the lean CPU
forward of the Llama family; `model/cpu_forward.py`). `model/loader.py` chooses between them,
once, and loads the chosen one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from asyncengine.model.attention import AttentionMetadata
from asyncengine.model.lora_layers import LoRABatch


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """The tokens a model may pick itself instead of returning logits: row i's argmax over its
    first `vocab_size` logits (first index on ties); with `temperatures` [S] (float32, 0 for a
    greedy row) and `noise` [S, >= vocab_size] (float32, `Sampler.gumbel_noise`), a row with
    T > 0 takes argmax(logits / T + noise) in fp32 instead: the sampler's Gumbel-max."""

    vocab_size: int
    temperatures: torch.Tensor | None = None
    noise: torch.Tensor | None = None


class ModelForward(Protocol):
    """One forward pass over a packed batch: every scheduled token of every request in one
    sequence, with its position.

    The runner guarantees: `input_ids` and `positions` are int64 on the model's device, one
    entry per token; `attn` holds this step's KV cache writes and attention plan for those
    tokens (built by `AttentionMetadata.build` for the model's backend); `logits_indices`
    names the packed rows whose logits are wanted, in order (possibly none). The model writes
    every token's K/V into the paged cache and returns the logits of those rows only, in the
    model's dtype, the vocabulary possibly padded past the tokenizer's.

    With a `TokenChoice` (the runner passes one when every row is sampled greedily or by
    temperature alone, with nothing that changes the logits first), a model may return the
    rows' tokens instead of their logits: [S] int64, exactly the tokens the sampler would
    pick from the logits it would have returned (CpuForward does, through an int8 screen of
    its lm_head).

    With `hidden_indices` (packed rows; embedding requests), the model also appends to
    `hidden_out` those rows' final hidden states, [H, hidden] after the final norm (what
    transformers' `AutoModel` returns as `last_hidden_state`), in the model's dtype.

    With `lora` (only to a model that takes adapters: CpuForward), the rows of each of its
    adapters run with that adapter's low-rank adds.
    """

    @property
    def token_choice_rows(self) -> int:
        """The most sampled rows for which it may return tokens (0: always logits): the
        runner passes no TokenChoice for more, and draws no noise for one."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
        token_choice: TokenChoice | None = None,
        hidden_indices: torch.Tensor | None = None,  # [H]
        hidden_out: list[torch.Tensor] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [S, V] logits, or [S] int64 token ids
        ...
