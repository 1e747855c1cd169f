"""Verifying drafts (worker/rejection_sampler.py): the acceptance rule, and that sampled
outputs keep the model's distribution and a seeded request's tokens."""

from __future__ import annotations

import pytest
import torch

from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.rejection_sampler import accept_drafts, draft_states
from asyncengine.worker.sampler import Sampler
from asyncengine.worker.sampling_metadata import SamplingRequestState, build_sampling_metadata

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("drafts", "sampled", "emitted"),
    [
        ([], [7], [7]),
        ([4, 5, 6], [4, 5, 6, 9], [4, 5, 6, 9]),  # every draft accepted, and the bonus token
        ([4, 5, 6], [4, 8, 6, 9], [4, 8]),  # the model's token at the first mismatch
        ([4, 5, 6], [1, 5, 6, 9], [1]),
        ([4, 4], [4, -1, 2], [4, -1]),  # an invalid (NaN) row stops there too
    ],
)
def test_drafts_are_kept_up_to_the_first_mismatch(
    drafts: list[int], sampled: list[int], emitted: list[int]
) -> None:
    assert accept_drafts(drafts, sampled) == emitted


def test_a_row_needs_a_token_per_draft_and_one_more() -> None:
    with pytest.raises(ValueError, match="2 drafts need 3 sampled tokens"):
        accept_drafts([1, 2], [1, 2])


def _state(output: list[int], **params: object) -> SamplingRequestState:
    return SamplingRequestState(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=[1, 2, 3],
        output_token_ids=output,
        eos_token_ids=(0,),
    )


def test_each_position_samples_as_if_the_drafts_before_it_were_outputs() -> None:
    state = _state([5], temperature=0.8, seed=11, min_tokens=3, presence_penalty=0.5)
    states = draft_states(state, [7, 8])
    assert states[0] is state
    assert [s.output_token_ids for s in states] == [[5], [5, 7], [5, 7, 8]]
    assert state.output_token_ids == [5]  # the request's own list is left alone
    # So a seeded position draws the noise of its output step, and gives the very token the
    # request would sample there without speculation.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g)
    sampler = Sampler()
    together = sampler(logits, build_sampling_metadata(states, 40, CPU)).sampled_token_ids
    for i, alone_state in enumerate(states):
        alone = sampler(logits[i : i + 1], build_sampling_metadata([alone_state], 40, CPU))
        assert alone.sampled_token_ids.item() == together[i].item()


def test_sampled_outputs_keep_the_models_distribution() -> None:
    """One draft d against p = softmax(logits): d is accepted with probability p(d); the
    emitted first token is distributed as p; after a rejection, as p without d, normalised.
    Chi-square over 6,000 seeded draws (critical values at p = 0.001)."""
    torch.manual_seed(1234)  # the unseeded rows' noise: deterministic, as every test is
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    p = torch.softmax(logits, dim=0)
    vocab, draft, draws = len(p), 1, 6000
    state = _state([], temperature=1.0)
    states = draft_states(state, [draft]) * draws  # 2 positions per draw, all in one batch
    batch = logits.repeat(2 * draws, 1)
    sampled = Sampler()(batch, build_sampling_metadata(states, vocab, CPU)).sampled_token_ids
    firsts = torch.zeros(vocab)
    after_rejection = torch.zeros(vocab)
    accepted = 0
    for i in range(draws):
        emitted = accept_drafts([draft], sampled[2 * i : 2 * i + 2].tolist())
        firsts[emitted[0]] += 1
        if len(emitted) == 2:
            accepted += 1
        else:
            after_rejection[emitted[0]] += 1

    def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
        expected = probs * counts.sum()
        keep = expected > 0
        return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())

    assert chi_square(firsts, p) < 20.5  # 5 degrees of freedom
    rest = p.clone()
    rest[draft] = 0.0
    assert after_rejection[draft] == 0
    assert chi_square(after_rejection, rest / rest.sum()) < 18.5  # 4 degrees of freedom
    # Acceptance: binomial(6000, p(d)); 4 standard deviations.
    mean = draws * float(p[draft])
    assert abs(accepted - mean) < 4 * (mean * (1 - float(p[draft]))) ** 0.5


def test_greedy_rows_accept_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    states = draft_states(_state([], temperature=0.0), [1, 2])
    sampled = Sampler()(logits, build_sampling_metadata(states, 3, CPU)).sampled_token_ids
    assert accept_drafts([1, 2], sampled.tolist()) == [1, 0]
