"""Sampler: greedy, filters, seeded and unseeded sampling, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.sampler import (
    Sampler,
    SamplerOutput,
    process_logits,
)
from asyncengine.worker.sampling_metadata import (
    SamplingRequestState,
    build_sampling_metadata,
    step_seed,
)

V = 64
CPU = torch.device("cpu")


def state(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
    **params: object,
) -> SamplingRequestState:
    return SamplingRequestState(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=list(prompt or [1, 2, 3]),
        output_token_ids=list(output or []),
        eos_token_ids=eos,
    )


def sample(logits: torch.Tensor, states: list[SamplingRequestState]) -> SamplerOutput:
    metadata = build_sampling_metadata(states, logits.shape[-1], CPU)
    out: SamplerOutput = Sampler()(logits, metadata)
    return out


def random_logits(rows: int, seed: int, vocab: int = V, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_batch_is_argmax_and_builds_no_tensors() -> None:
    logits = random_logits(8, 0)
    states = [state(temperature=0.0) for _ in range(8)]
    metadata = build_sampling_metadata(states, V, CPU)
    assert metadata.all_greedy
    assert metadata.temperature is None and metadata.no_penalties
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_any_float_dtype_and_input_untouched(dtype: torch.dtype) -> None:
    logits = random_logits(4, 1).to(dtype)
    before = logits.clone()
    states = [state(temperature=0.0, presence_penalty=1.0, output=[5]) for _ in range(4)]
    out = sample(logits, states)
    assert out.sampled_token_ids.shape == (4,)
    assert torch.equal(logits, before)  # the sampler works on a copy


def test_mixed_greedy_and_random_rows() -> None:
    # One dominant token per row, so greedy rows are certain; random rows are free to roam.
    logits = torch.zeros(6, V)
    states = []
    for row in range(6):
        if row % 2 == 0:
            logits[row, row] = 1.0  # greedy: argmax is `row`, though barely
            states.append(state(temperature=0.0))
        else:
            logits[row, 10:20] = 50.0  # random: only tokens 10..19 have any mass
            states.append(state(temperature=1.0))
    metadata = build_sampling_metadata(states, V, CPU)
    assert not metadata.all_greedy and not metadata.all_random
    for _ in range(20):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        for row in range(6):
            token = int(sampled[row])
            assert token == row if row % 2 == 0 else 10 <= token < 20


def test_tiny_temperature_is_greedy() -> None:
    logits = random_logits(3, 2)
    out = sample(logits, [state(temperature=1e-9) for _ in range(3)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


# -- filters never let a token outside the allowed set through ------------------------------------


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a correct sampler may pick for one row: a float64 reference, loose at the edges."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = x.softmax(-1)
    allowed = probs > 0
    if p.top_p < 1.0:
        # A token belongs to the nucleus iff the mass strictly above it is < p.
        above = (probs.unsqueeze(0) > probs.unsqueeze(1)).double() @ probs
        allowed &= above < p.top_p + 1e-4
    if p.min_p > 0.0:
        allowed &= probs >= p.min_p * probs.max() * (1 - 1e-4)
    return set(torch.nonzero(allowed).flatten().tolist())


@settings(deadline=None, max_examples=40, derandomize=True)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.sampled_from([0, 1, 3, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.1, 0.6]),
    scale=st.sampled_from([0.5, 3.0, 10.0]),
)
def test_filters_never_sample_outside_the_allowed_set(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float, scale: float
) -> None:
    rows = 6
    logits = random_logits(rows, seed, scale=scale)
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    # Half the rows seeded, and one plain row that forces mixed filter settings in the batch.
    states = [state(seed=seed + r if r % 2 else None, **params) for r in range(rows - 1)]
    states.append(state(temperature=1.0))
    metadata = build_sampling_metadata(states, V, CPU)
    sampler = Sampler()
    allowed = [_allowed(logits[r], states[r].params) for r in range(rows)]
    torch.manual_seed(seed)
    for _ in range(10):
        sampled = sampler(logits, metadata).sampled_token_ids.tolist()
        for r in range(rows):
            assert sampled[r] in allowed[r]


def test_top_k_one_is_argmax() -> None:
    logits = random_logits(5, 3)
    out = sample(logits, [state(temperature=5.0, top_k=1) for _ in range(5)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("with_top_p", [False, True])
def test_each_row_keeps_exactly_its_own_top_k(with_top_p: bool) -> None:
    # Distinct, nearly flat logits: each row's top-k set is exact and every member is likely.
    ks = [1, 2, 5, 9]
    logits = torch.randperm(V, generator=torch.Generator().manual_seed(0)).float() * 0.01
    logits = logits.repeat(len(ks), 1)  # [4, V]
    top_p = 0.999 if with_top_p else 1.0  # top-p forces the full-sort path
    states = [state(temperature=1.0, top_k=k, top_p=top_p) for k in ks]
    metadata = build_sampling_metadata(states, V, CPU)
    assert metadata.num_filter_candidates == 9
    torch.manual_seed(0)
    seen: list[set[int]] = [set() for _ in ks]
    for _ in range(200):
        for r, token in enumerate(Sampler()(logits, metadata).sampled_token_ids.tolist()):
            seen[r].add(token)
    for r, k in enumerate(ks):
        assert seen[r] == set(logits[r].topk(k).indices.tolist())


def test_top_k_only_rows_with_unfiltered_rows_keep_the_tail() -> None:
    # The top-k row takes the partial-topk path; the unfiltered row must still reach its tail.
    logits = torch.zeros(2, V)
    logits[0, :5] = 10.0
    states = [state(temperature=1.0, top_k=5), state(temperature=1.0)]
    metadata = build_sampling_metadata(states, V, CPU)
    assert metadata.num_filter_candidates == 5
    torch.manual_seed(0)
    seen: set[int] = set()
    for _ in range(50):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        assert int(sampled[0]) < 5
        seen.add(int(sampled[1]))
    assert len(seen) > 20  # uniform over 64 tokens


def test_masked_tokens_never_win_even_with_extreme_logits() -> None:
    # All the raw mass is on EOS, masked by min_tokens; every other token but 0 underflows to
    # probability 0. The race must pick token 0, never a zero-probability token.
    logits = torch.full((4, V), -1e4)
    logits[:, 0] = 0.0
    logits[:, 1] = 1e4
    states = [state(temperature=1.0, min_tokens=3, eos=(1,)) for _ in range(4)]
    for _ in range(20):
        assert sample(logits, states).sampled_token_ids.tolist() == [0, 0, 0, 0]


# -- seeded sampling ------------------------------------------------------------------------------


def _seeded_run(seed: int, row: int, batch: int, steps: int, logits_seed: int) -> list[int]:
    """Sample `steps` tokens for a seeded request at `row` of a batch of unseeded others."""
    sampler = Sampler()
    target = state(temperature=1.0, top_p=0.9, seed=seed)
    others = [state(temperature=0.7, top_k=10) for _ in range(batch - 1)]
    for step in range(steps):
        states = [*others[:row], target, *others[row:]]
        logits = random_logits(batch, 1000 + step, scale=1.0)  # flat: many plausible tokens
        logits[row] = random_logits(1, logits_seed + step, scale=1.0)[0]
        out = sampler(logits, build_sampling_metadata(states, V, CPU))
        target.output_token_ids.append(int(out.sampled_token_ids[row]))
    return target.output_token_ids


def test_seeded_row_is_independent_of_batch_and_row() -> None:
    torch.manual_seed(0)
    alone = _seeded_run(seed=42, row=0, batch=1, steps=12, logits_seed=7)
    torch.manual_seed(1)  # different global noise for the unseeded neighbours
    in_batch = _seeded_run(seed=42, row=3, batch=5, steps=12, logits_seed=7)
    assert alone == in_batch


def test_seeded_row_survives_recompute() -> None:
    # After preemption, the runner rebuilds the request with the outputs it already has:
    # the next token depends only on (seed, number of outputs so far) and the logits.
    logits = random_logits(1, 5, scale=1.0)
    full = state(temperature=1.0, seed=9, output=[3, 4, 5])
    fresh = state(temperature=1.0, seed=9, output=[3, 4, 5])
    torch.manual_seed(0)
    a = sample(logits, [full]).sampled_token_ids
    torch.manual_seed(123)
    b = sample(logits.repeat(2, 1), [state(temperature=0.0), fresh]).sampled_token_ids[1:]
    assert torch.equal(a, b)


def test_different_seeds_give_different_sequences() -> None:
    runs = [_seeded_run(seed=s, row=0, batch=2, steps=12, logits_seed=7) for s in (1, 2, 3)]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_step_seed_is_a_pure_function_of_seed_and_step() -> None:
    assert step_seed(5, 3) == step_seed(5, 3)
    values = {step_seed(s, t) for s in range(50) for t in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**63 for v in values)


# -- unseeded statistics --------------------------------------------------------------------------


def test_unseeded_samples_follow_the_distribution() -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0]]).repeat(4000, 1)  # [4000, 6]
    probs = logits[0].softmax(-1).double()
    states = [state(temperature=1.0) for _ in range(4000)]
    sampled = sample(logits, states).sampled_token_ids
    counts = torch.bincount(sampled, minlength=6).double()
    expected = probs * 4000
    # Pearson chi-square over the 5 live tokens (df = 4): 99.9th percentile is ~18.5.
    chi2 = (((counts - expected) ** 2) / expected)[:5].sum().item()
    assert chi2 < 18.5
    assert counts[5] == 0


def test_temperature_flattens_and_sharpens() -> None:
    torch.manual_seed(7)
    logits = torch.tensor([[1.0, 0.0]]).repeat(4000, 1)
    hot = sample(logits, [state(temperature=100.0)] * 4000).sampled_token_ids.double().mean()
    cold = sample(logits, [state(temperature=0.1)] * 4000).sampled_token_ids.double().mean()
    assert 0.45 < hot < 0.55  # near uniform
    assert cold < 0.01  # almost always token 0


# -- penalties ------------------------------------------------------------------------------------


def _processed_logits(logits: torch.Tensor, st_: SamplingRequestState) -> torch.Tensor:
    """The logits after min_tokens and penalties: what a greedy row takes the argmax of."""
    metadata = build_sampling_metadata([st_], logits.shape[-1], CPU)
    return process_logits(logits, metadata)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    st_ = state(temperature=0.0, repetition_penalty=2.0, prompt=[0], output=[1, 1])
    out = _processed_logits(logits, st_)
    # token 0 (prompt, positive) halves; token 1 (output, negative) doubles; others untouched.
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_frequency_penalty_subtracts_per_occurrence_in_output_only() -> None:
    logits = torch.zeros(1, 5)
    st_ = state(temperature=0.0, frequency_penalty=0.5, prompt=[4, 4], output=[1, 1, 1, 2])
    assert _processed_logits(logits, st_).tolist() == [[0.0, -1.5, -0.5, 0.0, 0.0]]


def test_presence_penalty_subtracts_once_for_output_tokens() -> None:
    logits = torch.zeros(1, 5)
    st_ = state(temperature=0.0, presence_penalty=-1.0, prompt=[4], output=[1, 1, 1, 2])
    assert _processed_logits(logits, st_).tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]


@settings(deadline=None, max_examples=30, derandomize=True)
@given(data=st.data())
def test_penalties_match_a_dense_per_row_reference(data: st.DataObject) -> None:
    vocab = 12
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)  # repeats and the last id included
    states = []
    for _ in range(data.draw(st.integers(1, 4))):
        states.append(
            state(
                temperature=data.draw(st.sampled_from([0.0, 1.0])),
                prompt=data.draw(tokens) or [0],
                output=data.draw(tokens),
                presence_penalty=data.draw(st.sampled_from([0.0, 0.7, -1.5])),
                frequency_penalty=data.draw(st.sampled_from([0.0, 0.3, -2.0])),
                repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.5])),
            )
        )
    logits = random_logits(len(states), data.draw(st.integers(0, 1000)), vocab=vocab)
    got = process_logits(logits, build_sampling_metadata(states, vocab, CPU))

    for row, s in enumerate(states):
        p, x = s.params, logits[row].clone()
        for t in set(s.prompt_token_ids) | set(s.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(s.output_token_ids):
            x[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
        torch.testing.assert_close(got[row], x)


def test_penalties_apply_per_row_and_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    states = [
        state(temperature=0.0, frequency_penalty=2.0, output=[0]),  # 3 - 2 < 2: picks 1
        state(temperature=0.0, output=[0]),  # no penalty: picks 0
        state(temperature=0.0, repetition_penalty=2.0, prompt=[0]),  # 3 / 2 < 2: picks 1
    ]
    assert sample(logits, states).sampled_token_ids.tolist() == [1, 0, 1]


# -- min_tokens -----------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0  # EOS, the favourite
    logits[0, 5] = 9.0  # a stop id, next best
    logits[0, 6] = 8.0
    short = state(temperature=0.0, min_tokens=3, stop_token_ids=[5], eos=(2,), output=[0, 0])
    assert sample(logits, [short]).sampled_token_ids.tolist() == [6]
    masked = _processed_logits(logits, short)
    assert masked[0, 2] == -math.inf and masked[0, 5] == -math.inf
    done = state(temperature=0.0, min_tokens=3, stop_token_ids=[5], eos=(2,), output=[0, 0, 0])
    assert sample(logits, [done]).sampled_token_ids.tolist() == [2]


def test_min_tokens_masks_eos_even_with_ignore_eos_and_skips_out_of_vocab_ids() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0
    st_ = state(temperature=0.0, min_tokens=1, ignore_eos=True, stop_token_ids=[99], eos=(2,))
    assert sample(logits, [st_]).sampled_token_ids.tolist() != [2]


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = random_logits(4, 11)
    raw = logits.log_softmax(-1)
    top0 = int(logits[0].argmax())
    states = [
        state(temperature=0.0, logprobs=3, frequency_penalty=2.0, output=[top0] * 5),
        state(temperature=1.0, logprobs=1),
        state(temperature=0.5, top_k=2),  # asks for none: still gets the batch's columns
        state(temperature=0.0, logprobs=0),
    ]
    out = sample(logits, states)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.sampled_token_ranks is not None
    assert out.logprobs.shape == (4, 4) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.shape == (4, 4)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    # Column 0: the sampled token's logprob from the RAW logits (before the penalty).
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    # Columns 1..N: the top-N by raw logprob, descending.
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    # The penalised greedy row did not pick the raw argmax, so its rank is > 1.
    assert int(sampled[0]) != int(logits[0].argmax())
    for r in range(4):
        expected_rank = int((raw[r] >= raw[r, sampled[r]]).sum())
        assert int(out.sampled_token_ranks[r]) == expected_rank
    assert int(out.sampled_token_ranks[3]) == 1  # a plain greedy row takes the top token


def test_logprobs_zero_gives_only_the_sampled_column() -> None:
    logits = random_logits(2, 12)
    out = sample(logits, [state(temperature=0.0, logprobs=0), state(temperature=0.0)])
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], logits.log_softmax(-1).max(-1).values)


def test_logprobs_of_half_precision_logits_are_float32() -> None:
    logits = random_logits(2, 13).to(torch.bfloat16)
    out = sample(logits, [state(temperature=0.0, logprobs=2)] * 2)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    expected = logits.float().log_softmax(-1).topk(2, dim=-1).values
    torch.testing.assert_close(out.logprobs[:, 1:], expected)


# -- metadata -------------------------------------------------------------------------------------


def test_metadata_leaves_unused_stages_out() -> None:
    states = [state(temperature=0.8), state(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)]
    metadata = build_sampling_metadata(states, V, CPU)
    # The only filters belong to a greedy row, where they mean nothing.
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.num_filter_candidates == 0
    assert metadata.no_penalties and metadata.min_tokens_indices is None
    assert metadata.max_num_logprobs is None and metadata.generator_seeds == {}
    assert metadata.greedy_mask is not None and metadata.greedy_mask.tolist() == [False, True]


def test_metadata_pads_penalty_tokens_with_vocab_size() -> None:
    states = [
        state(temperature=0.0, repetition_penalty=1.5, prompt=[1, 2], output=[3]),
        state(temperature=0.0, prompt=[4, 5, 6], output=[7, 8]),  # no penalty: padding only
    ]
    metadata = build_sampling_metadata(states, V, CPU)
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    assert metadata.prompt_token_ids.tolist() == [[1, 2], [V, V]]
    assert metadata.output_token_ids.tolist() == [[3], [V]]


@pytest.mark.parametrize("vocab", [512, 1000, 32000])
def test_fast_argmax_equals_argmax_first_index_on_ties(vocab: int) -> None:
    from asyncengine.worker.sampler import fast_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(16, vocab, generator=g)
    x[3, 7] = x[3, vocab - 2] = 50.0  # a tie: the first index wins
    x[4, 200] = x[4, 130] = 60.0  # a tie inside and across chunks
    for t in (x, x.bfloat16()):
        assert torch.equal(fast_argmax(t), t.float().argmax(dim=-1))
    assert fast_argmax(x)[3].item() == 7 and fast_argmax(x)[4].item() == 130
