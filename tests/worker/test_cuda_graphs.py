"""Decode steps through CUDA graphs (worker/cuda_graphs.py) give the tokens eager steps give.

On a CPU the padded, persistent-buffer decode path runs uncaptured under Triton's interpreter
(everything but the capture); on a GPU (marked `gpu`) the graphs are captured and replayed.
Greedy, fp32, a batch that shrinks across buckets as requests finish and grows as waiting ones
join: tokens equal to the eager run's.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from asyncengine import LLM, SamplingParams
from asyncengine.testing import build_tiny_model
from asyncengine.worker import cuda_graphs
from asyncengine.worker.cuda_graphs import capture_sizes
from asyncengine.worker.model_runner import ModelRunner


def test_capture_sizes_are_powers_of_two_up_to_the_bucket_holding_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert capture_sizes(100_000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("graphs") / "llama", "llama", dtype="float32")


def _generate(model: Path, device: str, graphs: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Greedy tokens of two waves of 12 prompts, at most 8 running at once; and the row count
    of each decode step that went through the graphs."""
    replays: list[int] = []
    run = cuda_graphs.DecodeGraphs.run

    def counted(self: cuda_graphs.DecodeGraphs, *args: Any) -> torch.Tensor:
        out = run(self, *args)
        replays.append(out.shape[0])
        return out

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", counted)
    if device == "cpu":  # graphs are a CUDA feature: turn the padded path on by hand
        monkeypatch.setattr(ModelRunner, "uses_cuda_graphs", property(lambda self: graphs))
    llm = LLM(
        model,
        device=device,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=not graphs,
        max_num_seqs=8,
        max_model_len=128,
        num_kv_blocks=128,
        block_size=16,
    )
    try:
        prompts = [[5 + i, 9, 13 + 2 * i, 7, *range(20, 20 + 3 * i)] for i in range(12)]
        params = [
            SamplingParams(temperature=0.0, max_tokens=3 + (i * 5) % 11, ignore_eos=True)
            for i in range(12)
        ]
        tokens = []
        # Twice: the batch shrinks to one row by the end of a wave, then grows back to 8.
        for wave in (prompts, prompts[::-1]):
            outs = llm.generate(wave, params, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
    return tokens, replays


# `device` is "cpu" (uncaptured, interpreter) or "cuda" (marked gpu): tests/conftest.py.
@pytest.mark.timeout(600)
def test_graph_decode_steps_equal_eager_ones(
    model: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, none = _generate(model, device, False, monkeypatch)
    assert none == []
    graphed, replays = _generate(model, device, True, monkeypatch)
    assert graphed == eager
    # The batch shrank through several buckets, and grew again.
    assert len(set(replays)) >= 4, replays
    assert any(b > a for a, b in itertools.pairwise(replays)), replays
