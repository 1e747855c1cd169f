"""Embedding requests (`AsyncLLM.embed`, `LLM.embed`): what they take and what they return.

An embedding request is a prompt the core prefills and never decodes: the model's final hidden
states (after the final norm, as transformers' `AutoModel` gives `last_hidden_state`) of its
tokens are pooled in the model runner, "last" (the last token's: decoder embedding models such
as Qwen3-Embedding), "mean" (over every token) or "cls" (the first token's), and sent back as
one fp32 vector. Here, in the client, it is cut to `dimensions` (Matryoshka truncation) and
then L2-normalized when asked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from asyncengine.client.input_processor import Prompt
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

POOLINGS = ("last", "mean", "cls")
MAX_INPUTS = 2048  # per call, as OpenAI's /v1/embeddings

# An embedding request samples nothing; these only satisfy the request checks (a prompt may
# take the whole context but one position).
EMBED_PARAMS = SamplingParams(
    max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
)


def embedding_inputs(inputs: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """`inputs` as a list of prompts: one string, one list of token ids, or a list of those.
    ValueError for anything else, an empty list or more than MAX_INPUTS."""
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes):
        raise ValueError(
            f"inputs must be a string, a list of token ids, or a list of those; not "
            f"{type(inputs).__name__}"
        )
    if not inputs:
        raise ValueError("inputs is empty: give at least one text or list of token ids")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        return [list(inputs)]  # type: ignore[arg-type]
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"{len(inputs)} inputs in one call: at most {MAX_INPUTS}")
    prompts: list[Prompt] = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, Sequence) and not isinstance(item, bytes):
            prompts.append([int(t) for t in item])  # the tokenizer checks them
        else:
            raise ValueError(
                f"inputs[{i}] must be a string or a list of token ids, not {type(item).__name__}"
            )
    return prompts


def check_embed_options(pooling: str, normalize: bool, dimensions: int | None, hidden: int) -> None:
    """ValueError naming a bad option (`hidden`: the model's hidden size)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is invalid: one of {', '.join(POOLINGS)}")
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize must be True or False, not {normalize!r}")
    if dimensions is not None and (
        not isinstance(dimensions, int)
        or isinstance(dimensions, bool)
        or not 1 <= dimensions <= hidden
    ):
        raise ValueError(
            f"dimensions={dimensions!r} is invalid: an integer from 1 to the model's hidden "
            f"size, {hidden}"
        )


def finish_vector(pooled: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The pooled vector cut to its first `dimensions` values, then L2-normalized (a zero
    vector stays zero)."""
    vector = pooled[:dimensions] if dimensions is not None else list(pooled)
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in vector))
        if norm > 0:
            vector = [v / norm for v in vector]
    return vector
