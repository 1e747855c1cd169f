"""Sampler: logits [B, V] → one token per row, vectorised across the batch (vLLM v1 semantics).

Steps, in order:
  1. logprobs of the RAW logits (float32 log_softmax), when any row asks for them;
  2. min_tokens: EOS and stop ids → -inf for rows still short of min_tokens;
  3. penalties: repetition (prompt + output), frequency and presence (output);
  4. greedy rows: argmax of the penalised logits;
  5. random rows: temperature → top-k → top-p → min-p → Gumbel-max (argmax of logits plus
     Gumbel noise: a sample of their softmax);
  6. gather the sampled token's logprob and rank, and the top-N logprobs.

Host decisions come from `SamplingMetadata` (Python values), so no step reads a tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.kernels.argmax_cpu import argmax_cpu
from asyncengine.kernels.cpu_native import load_native, supported
from asyncengine.worker.sampling_metadata import SamplingMetadata

# Uniform noise is clamped into [_TINY, _ONE_BELOW] so that -log(u) is finite and > 0, and
# the Gumbel noise -log(-log(u)) finite: an infinite one would beat any logit, or turn a
# masked token's -inf into NaN, which argmax ranks first.
_TINY = torch.finfo(torch.float32).tiny
_ONE_BELOW = 1.0 - 2.0**-24  # the largest float32 below 1


@dataclass(slots=True)
class SamplerOutput:
    """One step's samples, one row per `SamplingMetadata` row.

    With logprobs (N = `max_num_logprobs`), column 0 is the sampled token and columns
    1..N the N most likely tokens by raw logprob, in descending order; a row that asked for
    n < N logprobs reads columns [0, n]. Ranks count tokens at least as likely as the sampled
    one (1 = most likely).
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, N + 1] int64
    logprobs: torch.Tensor | None = None  # [B, N + 1] float32
    sampled_token_ranks: torch.Tensor | None = None  # [B] int64


class Sampler(torch.nn.Module):
    """Samples one token per row from logits, as `SamplingMetadata` says."""

    def __init__(self) -> None:
        super().__init__()
        # One reusable generator per device, reseeded for each seeded row.
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V], any float dtype, V = `metadata.vocab_size`; left unmodified."""
        assert logits.shape == (metadata.num_rows, metadata.vocab_size), logits.shape
        # 1. Raw logprobs, before anything below changes the logits.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [B, V]

        needs_processing = metadata.min_tokens_indices is not None or not metadata.no_penalties
        if metadata.all_greedy and not needs_processing:
            sampled = fast_argmax(logits)  # [B] — the fast path: nothing else to do
        else:
            # 2.-3. (without them, no copy: `_sample` works out of place on its input)
            x = process_logits(logits, metadata) if needs_processing else logits.float()
            sampled = self._sample(x, metadata)  # 4.-5.

        # 6.
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        assert metadata.max_num_logprobs is not None
        return _gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] float32 (maybe a strided view), not modified. Returns [B] int64."""
        greedy = None if metadata.all_random else fast_argmax(logits)  # [B]
        if metadata.all_greedy:
            assert greedy is not None
            return greedy

        assert metadata.temperature is not None
        # Out of place: this also makes a strided view from `process_logits` contiguous.
        logits = logits / metadata.temperature.unsqueeze(1)  # [B, V]
        if metadata.num_filter_candidates:
            _apply_top_k_top_p(logits, metadata)
        if metadata.min_p is not None:
            _apply_min_p(logits, metadata.min_p)
        # Gumbel-max: argmax(x + g) is a sample of softmax(x); filtered tokens hold -inf.
        sampled = fast_argmax(logits.add_(self.gumbel_noise(metadata, logits.shape[1])))  # [B]

        if greedy is not None:
            assert metadata.greedy_mask is not None
            sampled = torch.where(metadata.greedy_mask, greedy, sampled)
        return sampled

    def gumbel_noise(self, metadata: SamplingMetadata, vocab_size: int) -> torch.Tensor:
        """g = -log(-log(u)), u ~ U(0, 1) i.i.d., [B, V] float32: argmax(x + g) samples from
        softmax(x), with no softmax, cumsum or sync.

        Seeded rows overwrite their noise with their own generator, so their tokens depend
        only on (seed, step) and their logits, whatever their batch; the model may take this
        noise to pick the tokens itself (ModelForward's `token_choice`). On CPU, uniform_ and
        two logs are ~5x faster than exponential_.
        """
        device = metadata.temperature.device if metadata.temperature is not None else None
        u = torch.empty(metadata.num_rows, vocab_size, dtype=torch.float32, device=device)
        if len(metadata.generator_seeds) < metadata.num_rows:
            u.uniform_()  # one batched draw for every unseeded row
        if metadata.generator_seeds:
            generator = self._generator(u.device)
            for row, seed in metadata.generator_seeds.items():
                generator.manual_seed(seed)
                u[row].uniform_(generator=generator)
        # -log(u) is Exp(1), in (0, 88] after the clamp; g = -log of that, in [-4.5, 16.7).
        return u.clamp_(_TINY, _ONE_BELOW).log_().neg_().log_().neg_()

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """min_tokens and penalties on a float32 copy of `logits` [B, V]: what greedy rows argmax.

    The result may be a strided view (rows of a [B, V + 1] buffer); `logits` is not modified.
    """
    num_rows, vocab_size = logits.shape
    if metadata.no_penalties:
        x = logits.to(torch.float32, copy=True)  # [B, V]
    else:
        # A spare column V absorbs the padding of the penalty token lists, then is dropped.
        buffer = torch.empty(num_rows, vocab_size + 1, dtype=torch.float32, device=logits.device)
        buffer[:, :vocab_size] = logits
        _apply_penalties(buffer, metadata)
        x = buffer[:, :vocab_size]  # [B, V]
    _apply_min_tokens(x, metadata)
    return x


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Forbid EOS and stop ids (in place) for rows that have not produced min_tokens yet."""
    indices = metadata.min_tokens_indices  # [2, M]
    if indices is not None:
        logits[indices[0], indices[1]] = float("-inf")


def _apply_penalties(buffer: torch.Tensor, metadata: SamplingMetadata) -> None:
    """vLLM's penalties, in place on `buffer` [B, V + 1] (logits plus a padding column).

    repetition: over tokens seen in the prompt or the output, positive logits are divided by
    the penalty and negative ones multiplied; frequency: minus penalty x count in the output;
    presence: minus penalty once for any token in the output.

    Only the B x L seen tokens change, so the work is done on [B, L] gathers and scattered
    back instead of on dense [B, V] masks (a repeated token writes the same value each time).
    """
    output_ids = metadata.output_token_ids  # [B, Lo], padded with V
    assert output_ids is not None
    assert metadata.presence_penalties is not None
    assert metadata.frequency_penalties is not None
    assert metadata.repetition_penalties is not None

    counts = torch.zeros_like(buffer)  # [B, V + 1]
    counts.scatter_add_(1, output_ids, torch.ones(output_ids.shape, device=buffer.device))

    if metadata.prompt_token_ids is None:
        seen_ids = output_ids  # [B, L]
        values = buffer.gather(1, seen_ids)  # [B, L]
    else:
        seen_ids = torch.cat([metadata.prompt_token_ids, output_ids], dim=1)  # [B, L]
        values = buffer.gather(1, seen_ids)  # [B, L]
        repetition = metadata.repetition_penalties.unsqueeze(1)  # [B, 1]
        values = torch.where(values > 0, values / repetition, values * repetition)

    occurrences = counts.gather(1, seen_ids)  # [B, L], 0 for prompt-only tokens
    values -= metadata.frequency_penalties.unsqueeze(1) * occurrences
    values -= metadata.presence_penalties.unsqueeze(1) * (occurrences > 0)
    buffer.scatter_(1, seen_ids, values)


def _apply_top_k_top_p(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Mask (in place) the logits outside each row's top-k, then outside its top-p nucleus.

    Both filters keep every logit >= a per-row threshold, found from the K most likely
    candidates (K = `num_filter_candidates`): a cheap `topk` when every filtering row has a
    small top-k, one full sort when some row's nucleus may reach any token. Ties with the
    threshold are kept, so a filter may keep slightly more than k tokens, never fewer.
    """
    vocab_size = metadata.vocab_size
    num_candidates = metadata.num_filter_candidates
    if num_candidates < vocab_size:
        # topk gives descending order; flip it to ascending like the sort below.
        candidates = logits.topk(num_candidates, dim=-1).values.flip(-1)  # [B, K]
    else:
        candidates = logits.sort(dim=-1).values  # [B, V], ascending

    # Candidates to drop form a prefix of the ascending order; count them per row.
    drop = torch.zeros_like(candidates, dtype=torch.bool)  # [B, K]
    if metadata.top_k is not None:
        # A row keeps its last k candidates (rows without top-k hold k = V >= K: keep all).
        position = torch.arange(num_candidates, device=logits.device)  # [K]
        drop |= position < (num_candidates - metadata.top_k).unsqueeze(1)
    if metadata.top_p is not None:
        # The nucleus after top-k: drop while the mass at or below a token is <= 1 - p,
        # i.e. while the tokens above it already hold at least p. The best token always stays.
        kept = candidates.masked_fill(drop, float("-inf"))  # [B, K]
        cumulative = kept.softmax(dim=-1).cumsum(dim=-1)  # [B, K]
        drop |= cumulative <= (1.0 - metadata.top_p).unsqueeze(1)
        drop[:, -1] = False
    num_dropped = drop.sum(dim=-1, keepdim=True)  # [B, 1]
    threshold = candidates.gather(1, num_dropped)  # [B, 1], the smallest kept logit
    if num_candidates < vocab_size and metadata.top_k is not None:
        # Rows that filter nothing: their tail lies beyond the K candidates.
        threshold.masked_fill_((metadata.top_k >= vocab_size).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < threshold, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask (in place) the tokens whose probability is below min_p x the row's highest, on
    the temperature-scaled logits [B, V]: p / p_max = exp(x - x_max) < min_p, so x below
    x_max + log(min_p) (min_p 0: -inf, nothing masked)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
    logits.masked_fill_(logits < threshold, float("-inf"))


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> SamplerOutput:
    """raw_logprobs: [B, V] float32; sampled: [B] int64."""
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)  # [B]
    token_ids = sampled.unsqueeze(1)  # [B, 1]
    logprobs = sampled_logprobs
    if num_logprobs > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [B, N] descending
        token_ids = torch.cat([token_ids, top_ids], dim=1)  # [B, N + 1]
        logprobs = torch.cat([logprobs, top_logprobs], dim=1)  # [B, N + 1]
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=token_ids,
        logprobs=logprobs,
        sampled_token_ranks=ranks,
    )


_ARGMAX_CHUNK = 128


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [B, V] (first index on ties), fast on CPU too.

    torch's CPU argmax is a scalar loop (~1.4 ms for 64 x 32000, a tenth of a small model's
    decode step). With the native CPU kernels: one vectorised pass per row, in the logits' own
    dtype (an fp32 copy of bf16 logits alone cost ~1 ms a step). Without them: a vectorised max
    per chunk of 128, an argmax over the chunk maxima and one within the winning chunk.
    """
    native = x.device.type == "cpu" and x.dim() == 2 and x.shape[-1] and supported(x)
    if native and load_native() is not None:
        out: torch.Tensor = argmax_cpu(x)
        return out
    if x.device.type != "cpu" or x.shape[-1] % _ARGMAX_CHUNK:
        return x.float().argmax(dim=-1)
    rows = x.shape[0]
    chunks = x.float().view(rows, -1, _ARGMAX_CHUNK)  # [B, V / 128, 128]
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [B] first chunk holding the max
    within = chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)  # [B]
    return best_chunk * _ARGMAX_CHUNK + within
