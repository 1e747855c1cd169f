"""Structured outputs on the worker: a step's grammar bitmask applied to the logits.

The engine core fills the bitmask (`sched/structured_outputs.py`); here it only masks: each
constrained row's disallowed tokens get -inf before the sampler runs, so every sampling method
(greedy, temperature, top-k/p, min-p, penalties) chooses among allowed tokens only.
"""

from __future__ import annotations

import torch

from asyncengine.sched.output import GrammarBitmask

_BITS = 32


def apply_grammar_bitmask(
    logits: torch.Tensor, sample_req_ids: list[str], grammar: GrammarBitmask
) -> None:
    """Mask (in place) the disallowed tokens of the rows `grammar` names.

    logits: [S, V] (a view is fine), row i samples for `sample_req_ids[i]`. The bitmask may
    be wider than V (it is rounded up to whole words); those bits are ignored.
    """
    row_of = {req_id: i for i, req_id in enumerate(sample_req_ids)}
    rows = [row_of[r] for r in grammar.req_ids]
    vocab_size = logits.shape[1]
    words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32)
    words = words.view(len(rows), -1).to(logits.device)  # [R, W]
    shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)  # [32]
    allowed = (words.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = allowed.view(len(rows), -1)[:, :vocab_size].bool()  # [R, V]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [R]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
