"""Structured outputs on the worker: a step's grammar bitmask applied to the logits.

The engine core fills the bitmask (`sched/structured_outputs.py`); here it only masks: each
constrained row's disallowed tokens get -inf before the sampler runs, so every sampling method
(greedy, temperature, top-k/p, min-p, penalties) chooses among allowed tokens only.
"""

from __future__ import annotations

import torch

from asyncengine.ipc.scheduler_output import GrammarBitmask
from asyncengine.kernels.bitmask_cpu import apply_bitmask_cpu
from asyncengine.kernels.cpu_native import load_native


def apply_grammar_bitmask(
    logits: torch.Tensor, sample_req_ids: list[str], grammar: GrammarBitmask
) -> None:
    """Mask (in place) the disallowed tokens of the rows `grammar` names.

    logits: [S, V] (a view is fine), row i samples for `sample_req_ids[i]`. The bitmask may
    be wider than V (it is rounded up to whole words); those bits are ignored.
    """
    row_of = {req_id: i for i, req_id in enumerate(sample_req_ids)}
    rows = [row_of[r] for r in grammar.req_ids]
    words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32)
    words = words.view(len(rows), -1)  # [R, W]
    index = torch.tensor(rows, dtype=torch.int64)  # [R]
    if logits.device.type == "cpu" and logits.stride(-1) == 1 and load_native() is not None:
        apply_bitmask_cpu(logits, index, words)
        return
    # Elsewhere (CUDA, or no native build), xgrammar's kernel. Past the tokenizer's last id (a
    # padded vocabulary: 151,936 logits for 49,152 ids, say) nothing is ever allowed: -inf in
    # one slice, and the kernel's bit-by-bit work stops at the last word allowing anything.
    import xgrammar

    used = words.any(dim=0).nonzero()
    num_words = int(used[-1]) + 1 if used.numel() else 0
    width = min(logits.shape[1], num_words * 32)
    if width < logits.shape[1]:
        logits[index.to(logits.device), width:] = float("-inf")
    if width == 0:
        return
    # The kernel indexes the bitmask by logits row: scatter our R rows to theirs.
    full = torch.full((logits.shape[0], num_words), -1, dtype=torch.int32)  # [S, W']
    full[index] = words[:, :num_words]
    xgrammar.apply_token_bitmask_inplace(
        logits, full.to(logits.device), vocab_size=width, indices=rows
    )
