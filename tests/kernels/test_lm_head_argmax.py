"""Greedy tokens from the int8 screen of the lm_head (kernels/lm_head_argmax_cpu.py).

Its contract is exactness: the index argmax gives over the logits the native product stores
(bf16, first index on ties), whatever the weights and rows, never an estimate; and None for a
row whose logits cannot be bounded, so that the caller computes them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels import linear_cpu
from asyncengine.kernels.argmax_cpu import argmax_cpu
from asyncengine.kernels.cpu_native import load_native
from asyncengine.kernels.lm_head_argmax_cpu import LmHeadArgmax

LIB = load_native()
pytestmark = pytest.mark.skipif(
    LIB is None or not LIB.linear_bf16_fast or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="the native kernel's fast path is not built (AVX512-BF16)",
)


def _layer(weight: torch.Tensor, bias: torch.Tensor | None) -> linear_cpu.LinearCpu:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    layer = linear_cpu.prepare_linear_cpu(weight, bias, packed)
    assert layer is not None
    return layer


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different scales, as an embedding's are (the int8 scale is per row).
    scales = torch.rand(n, 1, generator=g) * 0.1 + 0.01
    return (torch.randn(n, k, generator=g) * scales).to(torch.bfloat16)


def _rows(weight: torch.Tensor, rows: int, seed: int, peak: float) -> torch.Tensor:
    """Hidden rows near some weight rows' directions (a clear winner), plus noise."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, weight.shape[0], (rows,), generator=g)
    base = weight[picks].float()
    base = base / base.norm(dim=1, keepdim=True) * peak
    return (base + torch.randn(rows, weight.shape[1], generator=g)).to(torch.bfloat16)


def _expected(layer: linear_cpu.LinearCpu, x: torch.Tensor, vocab: int) -> torch.Tensor:
    return argmax_cpu(layer(x)[:, :vocab])


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("n", "k", "with_bias", "vocab"),
    [(4099, 96, True, 4000), (8192, 255, False, 8192), (3000, 576, False, 2999)],
)
def test_the_same_index_as_argmax_of_the_logits(
    n: int, k: int, with_bias: bool, vocab: int, threads: None
) -> None:
    weight = _weight(n, k, seed=n)
    bias = torch.randn(n).mul(0.5).to(torch.bfloat16) if with_bias else None
    layer = _layer(weight, bias)
    screen = LmHeadArgmax(layer)
    for trial, rows in enumerate((1, 2, 3, 5, 8, 11)):  # 11: two groups of the kernel
        for peak in (0.0, 20.0, 200.0):  # no winner, a clear one, a far one
            x = _rows(weight, rows, seed=trial, peak=peak)
            got = screen(x, vocab)
            assert got is not None
            assert torch.equal(got, _expected(layer, x, vocab)), (rows, peak)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_bias", [False, True])
def test_sampled_rows_pick_the_samplers_gumbel_max(with_bias: bool, threads: None) -> None:
    """Rows with a temperature take argmax(logits / T + noise) in fp32, as the sampler
    computes it from the logits, bit for bit; greedy rows (T = 0) beside them their argmax."""
    n, k, vocab = 6000, 128, 5990
    weight = _weight(n, k, seed=11)
    bias = torch.randn(n).mul(0.5).to(torch.bfloat16) if with_bias else None
    layer = _layer(weight, bias)
    screen = LmHeadArgmax(layer)
    g = torch.Generator().manual_seed(12)
    for trial, rows in enumerate((1, 3, 8, 10)):
        for temperature in (0.05, 0.7, 1.0, 5.0):
            x = _rows(weight, rows, seed=100 + trial, peak=30.0)
            temps = torch.full((rows,), temperature)
            temps[::3] = 0.0  # greedy rows between the sampled ones
            u = torch.rand(rows, n, generator=g).clamp_(torch.finfo(torch.float32).tiny, 1 - 2**-24)
            noise = -(-u.log()).log()  # Gumbel, as Sampler.gumbel_noise draws it
            got = screen(x, vocab, temps, noise)
            logits = layer(x)[:, :vocab]
            scores = logits / torch.where(temps > 0, temps, 1.0)[:, None] + noise[:, :vocab]
            want = torch.where(temps > 0, argmax_cpu(scores), argmax_cpu(logits))
            assert got is not None and torch.equal(got, want), (rows, temperature)


@pytest.mark.timeout(60)
def test_only_a_few_blocks_are_computed_exactly(threads: None) -> None:
    """Correct either way; but a loose bound would compute every block (no faster)."""
    weight = _weight(16384, 256, seed=3)  # 256 blocks
    screen = LmHeadArgmax(_layer(weight, None))
    x = _rows(weight, 4, seed=4, peak=40.0)
    assert screen(x, 16384) is not None
    assert 4 <= screen.exact_blocks <= 4 * 4


@pytest.mark.timeout(60)
def test_exact_ties_go_to_the_first_index(threads: None) -> None:
    weight = _weight(1024, 128, seed=5)
    weight[700] = weight[40] = weight[41] = weight[900] * 3  # the same logits, 4 blocks apart
    layer = _layer(weight, None)
    screen = LmHeadArgmax(layer)
    x = (weight[900].float() * 50).to(torch.bfloat16)[None]
    logits = layer(x)[0]
    assert logits[40] == logits[41] == logits[700] == logits.max()
    assert screen(x, 1024).tolist() == [40]  # type: ignore[union-attr]
    assert screen(x, 41).tolist() == [40]  # type: ignore[union-attr]
    # Outside `vocab`, a larger logit does not count.
    assert screen(x, 40).tolist() == _expected(layer, x, 40).tolist()  # type: ignore[union-attr]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_cannot_be_bounded_gives_none(bad: float, threads: None) -> None:
    weight = _weight(512, 64, seed=6)
    screen = LmHeadArgmax(_layer(weight, None))
    x = _rows(weight, 3, seed=7, peak=10.0)
    x[1, 5] = bad
    assert screen(x, 512) is None
    assert screen(x[[0, 2]], 512) is not None


@pytest.mark.timeout(120)
def test_preempted_pool_helpers_change_nothing(threads: None) -> None:
    weight = _weight(8192, 256, seed=8)
    layer = _layer(weight, None)
    screen = LmHeadArgmax(layer)
    xs = [_rows(weight, rows, seed=rows, peak=p) for rows in (1, 4, 8) for p in (0.0, 30.0)]
    linear_cpu.delay_pool_helpers(300_000)
    try:
        for _ in range(5):
            for x in xs:
                assert torch.equal(screen(x, 8192), _expected(layer, x, 8192))  # type: ignore[arg-type]
    finally:
        linear_cpu.delay_pool_helpers(0)


@pytest.mark.timeout(60)
def test_bad_arguments_are_named() -> None:
    screen = LmHeadArgmax(_layer(_weight(256, 64, seed=9), None))
    with pytest.raises(ValueError, match="bf16 rows of 64 values"):
        screen(torch.zeros(1, 63, dtype=torch.bfloat16), 256)
    with pytest.raises(ValueError, match="vocab <= 256"):
        screen(torch.zeros(1, 64, dtype=torch.bfloat16), 257)
    with pytest.raises(ValueError, match=r"noise \[1, >= 256\]"):
        screen(torch.zeros(1, 64, dtype=torch.bfloat16), 256, torch.ones(1), torch.zeros(1, 255))


@pytest.mark.timeout(60)
def test_the_int8_copy_bounds_its_rounding() -> None:
    """What the kernel's bound assumes: |w - s q| <= s / 2 and rnorm >= ||w - s q||_2 (the copy
    is built in C from the packed weight, here of 300 rows: 5 blocks, the last one padded)."""
    g = torch.Generator().manual_seed(10)
    w = (torch.randn(300, 77, generator=g) * torch.rand(300, 1, generator=g)).to(torch.bfloat16)
    w[3] = 0  # an all-zero row: scale 1, nothing to round
    w[4, 9] = 2.0**-120  # a tiny value: stays representable
    screen = LmHeadArgmax(_layer(w, None))
    q = screen.q.transpose(1, 2).reshape(-1, 77)  # [blocks * 64, K]
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    scale, rnorm = screen.scale.double(), screen.rnorm.double()
    assert torch.equal(
        scale[:300].float(),
        w.float().abs().amax(1).div(127).where(w.float().abs().amax(1) > 0, 1.0),
    )
    err = w.double() - scale[:300, None] * q[:300].double()
    assert bool((err.abs() <= scale[:300, None] / 2).all())
    assert bool((rnorm[:300] >= err.norm(dim=1)).all())
    assert scale[3] == 1.0 and rnorm[3] == 0.0
    assert bool((q[300:] == 0).all()) and bool((scale[300:] == 1.0).all())
