"""SamplingMetadata: one batch's sampling settings as tensors.

ModelRunner keeps a `SamplingRequestState` per request → `build_sampling_metadata(states)` once
per step → `Sampler.forward(logits, metadata)` → `SamplerOutput`.

Everything the sampler needs to decide on the host (which paths run, how wide a top-k is) is
a plain Python value here, so the sampler itself never reads a tensor back (no `.item()`).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from asyncengine.sampling_params import CoreSamplingParams
from asyncengine.worker.host_copy import to_device

# Temperatures below this are greedy, as in vLLM: dividing logits by a tiny temperature
# overflows float32, and softmax of a row of infinities is NaN.
SAMPLING_EPS = 1e-5

_MASK_63 = (1 << 63) - 1
_MASK_64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRequestState:
    """What the model runner keeps per request for sampling.

    The runner appends each sampled token to `output_token_ids`; the list must survive
    preemption (a recomputed request keeps its outputs), since seeded sampling and
    `min_tokens` count from its length.
    """

    params: CoreSamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling settings for B rows (B = `num_rows`), V = `vocab_size`.

    Optional tensors are None when no row needs them, so the sampler skips that stage.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; greedy rows hold 1.0 so one division serves the whole batch. None if all greedy.
    temperature: torch.Tensor | None = None
    # [B] bool, True for greedy rows. None when all rows are greedy or all are random.
    greedy_mask: torch.Tensor | None = None
    # [B] int64 in [1, V]; V means "no top-k". None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    # [B] float32 in (0, 1]; 1.0 means "no top-p". None when no random row uses top-p.
    top_p: torch.Tensor | None = None
    # [B] float32 in [0, 1]; 0.0 means "no min-p". None when no random row uses min-p.
    min_p: torch.Tensor | None = None
    # How many top candidates the top-k/top-p stage must look at (V: a full sort); 0 if none.
    num_filter_candidates: int = 0
    # row → the seed of that row's generator for this step (see `step_seed`).
    generator_seeds: dict[int, int] = field(default_factory=dict)
    # [2, M] int64: (row, token id) pairs forced to -inf, for rows still short of min_tokens.
    min_tokens_indices: torch.Tensor | None = None
    # [B] float32 each; all three None when no row uses a penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [B, L] int64, padded with V (a column the sampler drops). Rows without penalties are all
    # padding. `prompt_token_ids` is None when no row uses a repetition penalty.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # N = the most logprobs any row asked for (0 is valid: just the sampled token); None: no row.
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's `step`-th sampled token.

    A pure function of (seed, step), so a seeded request draws the same noise whatever its
    row, its batch-mates, or whether it was preempted and recomputed. splitmix64 mixing keeps
    nearby (seed, step) pairs far apart.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) & _MASK_63


def build_sampling_metadata(
    states: list[SamplingRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Tensors for one step: row i samples for `states[i]`.

    `vocab_size` is the width V of the logits the sampler will receive.
    """
    # The common case (a batch of plain greedy rows) is one cheap pass and no tensors.
    for state in states:
        p = state.params
        if (
            p.temperature >= SAMPLING_EPS
            or p.logprobs is not None
            or p.min_tokens > len(state.output_token_ids)
            or p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
        ):
            return _build_general(states, vocab_size, device)
    return SamplingMetadata(
        num_rows=len(states), vocab_size=vocab_size, all_greedy=True, all_random=False
    )


def _build_general(
    states: list[SamplingRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    num_rows = len(states)
    temperature: list[float] = []
    greedy: list[bool] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    generator_seeds: dict[int, int] = {}
    num_candidates = 0
    use_top_k = use_top_p = use_min_p = False
    min_tokens_rows: list[int] = []
    min_tokens_ids: list[int] = []
    presence: list[float] = []
    frequency: list[float] = []
    repetition: list[float] = []
    use_penalties = use_repetition = False
    prompt_rows: list[list[int]] = []
    output_rows: list[list[int]] = []
    max_num_logprobs: int | None = None

    for row, state in enumerate(states):
        p = state.params
        num_outputs = len(state.output_token_ids)

        # Random-sampling settings only matter for random rows; greedy rows get neutral values.
        if p.temperature < SAMPLING_EPS:
            greedy.append(True)
            temperature.append(1.0)
            top_k.append(vocab_size)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            greedy.append(False)
            temperature.append(p.temperature)
            k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            top_k.append(k)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            if k < vocab_size:
                use_top_k = True
                num_candidates = max(num_candidates, k)
            if p.top_p < 1.0:
                use_top_p = True
                # Without a top-k, the nucleus may reach any token: a full sort.
                num_candidates = max(num_candidates, k)
            if p.min_p > 0.0:
                use_min_p = True
            if p.seed is not None:
                generator_seeds[row] = step_seed(p.seed, num_outputs)

        # vLLM masks EOS (even with ignore_eos) and the stop ids until min_tokens are out.
        if p.min_tokens > num_outputs:
            for token_id in (*state.eos_token_ids, *(p.stop_token_ids or ())):
                if 0 <= token_id < vocab_size:
                    min_tokens_rows.append(row)
                    min_tokens_ids.append(token_id)

        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        repetition.append(p.repetition_penalty)
        penalised = bool(p.presence_penalty or p.frequency_penalty)
        if p.repetition_penalty != 1.0:
            penalised = use_repetition = True
            prompt_rows.append(state.prompt_token_ids)
        else:
            prompt_rows.append([])
        use_penalties |= penalised
        # Rows without penalties contribute padding only: their neutral values make their
        # counts irrelevant, and copying their tokens would cost time for nothing.
        output_rows.append(state.output_token_ids if penalised else [])

        if p.logprobs is not None:
            max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

    num_greedy = sum(greedy)
    all_greedy = num_greedy == num_rows
    all_random = num_greedy == 0

    def floats(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)

    metadata = SamplingMetadata(
        num_rows=num_rows,
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        generator_seeds=generator_seeds,
        max_num_logprobs=max_num_logprobs,
    )
    if not all_greedy:
        metadata.temperature = floats(temperature)
        if not all_random:
            metadata.greedy_mask = to_device(torch.tensor(greedy, dtype=torch.bool), device)
        if use_top_k:
            metadata.top_k = to_device(torch.tensor(top_k, dtype=torch.int64), device)
        if use_top_p:
            metadata.top_p = floats(top_p)
        if use_min_p:
            metadata.min_p = floats(min_p)
        metadata.num_filter_candidates = num_candidates
    if min_tokens_rows:
        metadata.min_tokens_indices = to_device(
            torch.tensor([min_tokens_rows, min_tokens_ids], dtype=torch.int64), device
        )
    if use_penalties:
        metadata.presence_penalties = floats(presence)
        metadata.frequency_penalties = floats(frequency)
        metadata.repetition_penalties = floats(repetition)
        metadata.output_token_ids = _pad(output_rows, vocab_size, device)
        if use_repetition:
            metadata.prompt_token_ids = _pad(prompt_rows, vocab_size, device)
    return metadata


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[B, L] int64 from ragged rows, padded with `pad` (L >= 1 so scatter shapes stay simple)."""
    width = max(1, max(len(r) for r in rows))
    padding = array.array("q", [pad]) * width
    # array.array + frombuffer is ~5x faster than torch.tensor(list) for long token lists.
    flat = array.array("q")
    for r in rows:
        flat.extend(r)
        flat.extend(padding[: width - len(r)])
    return to_device(torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width), device)
