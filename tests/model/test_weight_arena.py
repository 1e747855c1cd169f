"""WeightArena: a load's quantized weights side by side in large mappings, not in the file's
pages; the same tokens either way."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from test_gguf_engine import K_SHAPES, PROMPTS, _greedy
from test_gguf_files import Q, write_tiny_gguf

from asyncengine.model import weight_arena
from asyncengine.model.weight_arena import WeightArena

pytestmark = pytest.mark.timeout(300)


def test_copies_are_aligned_consecutive_and_keep_their_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weight_arena, "CHUNK_BYTES", 8 << 20)
    arena = WeightArena()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randint(0, 256, (n, 34), dtype=torch.uint8, generator=g) for n in (3, 70, 1)]
    copies = [arena.copy(w) for w in weights]
    for w, c in zip(weights, copies, strict=True):
        assert torch.equal(c, w) and c.shape == w.shape and c.data_ptr() != w.data_ptr()
        assert c.data_ptr() % 64 == 0
    # in order in one chunk: each after the one before, at the next 64-byte boundary
    for before, after in itertools.pairwise(copies):
        end = before.data_ptr() + before.numel()
        assert after.data_ptr() == -(-end // 64) * 64
    fp = arena.copy(torch.arange(12, dtype=torch.float32).view(3, 4))
    assert fp.dtype == torch.float32 and torch.equal(fp, torch.arange(12.0).view(3, 4))
    big = arena.copy(torch.ones(3 << 20, dtype=torch.uint8))  # over a quarter chunk: its own
    assert big.untyped_storage().data_ptr() != copies[0].untyped_storage().data_ptr()
    full = [arena.copy(torch.full((1 << 20,), i, dtype=torch.uint8)) for i in range(9)]
    assert full[-1].untyped_storage().data_ptr() != copies[0].untyped_storage().data_ptr()
    del arena  # the copies hold their chunks
    assert torch.equal(copies[1], weights[1]) and all(int(f[0]) == i for i, f in enumerate(full))


def test_a_repack_writes_into_the_arena_once() -> None:
    """decode_layout's repacks take their memory from `empty`: `keep` then holds them as they
    are (no second copy), and copies what was returned unchanged."""
    from asyncengine.kernels.quant_cpu import native_formats, repack_r8
    from asyncengine.kernels.quant_formats import random_blocks

    if "q8_0_r8" not in native_formats():
        pytest.skip("no native Q8_0_R8 repack in this build")
    arena = WeightArena()
    rows = random_blocks("q8_0", 16, 64, torch.Generator().manual_seed(1))
    r8 = repack_r8(rows, "q8_0", arena.empty)
    assert torch.equal(r8, repack_r8(rows, "q8_0")) and r8.data_ptr() % 64 == 0
    assert arena.keep(r8) is r8
    kept = arena.keep(rows)  # not the arena's: copied in, next to the repack
    assert kept is not rows and torch.equal(kept, rows)
    assert kept.untyped_storage().data_ptr() == r8.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="gave"):
        repack_r8(rows, "q8_0", lambda n, b: torch.empty(n, b + 1, dtype=torch.uint8))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_gguf_weights_load_into_the_arena_with_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: Q
) -> None:
    """Every QuantLinear's blocks lie outside the file's mapping (its pages released), and
    greedy tokens equal those read in place (the arena off)."""
    from asyncengine.config import EngineConfig
    from asyncengine.gguf import read_gguf
    from asyncengine.model import gguf_checkpoint
    from asyncengine.model.quant_linear import QuantLinear

    shapes = {"shapes": K_SHAPES} if qtype is Q.Q4_K else {}
    tiny = write_tiny_gguf(
        tmp_path / "a.gguf", "llama", weight_type=qtype, seed=3, tied=True, **shapes
    )
    config = EngineConfig.from_kwargs(tiny.path, device="cpu", dtype="bfloat16")
    forward = gguf_checkpoint.load_gguf_forward(config.model_config)
    layers = forward.linear_layers()
    assert layers and all(isinstance(m, QuantLinear) for m in layers)
    model = read_gguf(tiny.path)
    try:
        mapping = model.tensors["model.embed_tokens.weight"].data()
        start = mapping.ctypes.data - model.tensors["model.embed_tokens.weight"].offset
        end = start + tiny.path.stat().st_size
        for m in layers:
            address = m.qweight.data_ptr()  # type: ignore[union-attr]
            assert not start <= address < end
    finally:
        model.close()
    in_arena = _greedy(tiny.path)
    monkeypatch.setattr(weight_arena, "ENABLED", False)
    assert _greedy(tiny.path) == in_arena
    assert len(in_arena) == len(PROMPTS)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_folders_weights_give_the_same_tokens_in_the_arena(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """bf16 (the AVX2 panels go into the arena) and int8 (its blocks do)."""
    from asyncengine import LLM, SamplingParams

    def greedy() -> list[list[int]]:
        llm = LLM(tiny_llama, device="cpu", dtype="bfloat16", quantization=quantization)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()

    in_arena = greedy()
    monkeypatch.setattr(weight_arena, "ENABLED", False)
    assert greedy() == in_arena
