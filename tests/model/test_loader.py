"""One model interface: `loader.choose_model` chooses the forward from the config, and every
forward `load_model_forward` gives takes a packed step the same way and gives the same logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine.config import EngineConfig, ModelConfig
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.model import cpu_checkpoint
from asyncengine.model.attention import AttentionMetadata
from asyncengine.model.cpu_forward import CpuForward
from asyncengine.model.interface import ModelForward
from asyncengine.model.loader import choose_model, load_model_forward
from asyncengine.model.transformers_model import TransformersModel

pytestmark = pytest.mark.skipif(load_native() is None, reason=unavailable_reason())

CPU = torch.device("cpu")
BLOCK = 16


def _config(model_dir: Path, **kwargs: object) -> ModelConfig:
    return EngineConfig.from_kwargs(str(model_dir), device="cpu", **kwargs).model_config


def test_the_choice_follows_the_config(tiny_model_factory: Callable[..., Path]) -> None:
    llama = tiny_model_factory("llama")
    lean = choose_model(_config(llama))
    assert lean.lean_checkpoint and lean.native_cpu and lean.reason is None
    # Tensor parallel ranks load their shards through transformers, still on native kernels.
    sharded = choose_model(_config(llama), tensor_parallel=True)
    assert not sharded.lean_checkpoint and sharded.native_cpu
    assert "tensor parallel" in (sharded.reason or "")
    # The torch attention backend: transformers' forward, without the native ops.
    reference = choose_model(_config(llama, attention_backend="torch"))
    assert not reference.lean_checkpoint and not reference.native_cpu
    assert "backend" in (reference.reason or "")
    # A checkpoint the lean loader does not read: transformers loads it, native kernels run it.
    gelu = choose_model(_config(tiny_model_factory("llama", hidden_act="gelu")))
    assert not gelu.lean_checkpoint and gelu.native_cpu and "silu" in (gelu.reason or "")


def _step(
    model: ModelForward, kv_caches: list[torch.Tensor], backend: str, dtype: torch.dtype,
    positions: list[list[int]], block_ids: list[int], tokens: list[list[int]],
) -> torch.Tensor:  # fmt: skip
    """One packed step: request i's `tokens[i]` at `positions[i]`, its keys and values in KV
    block `block_ids[i]`; returns the logits of each request's last token, [S, V]."""
    counts = [len(p) for p in positions]
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    slots = [b * BLOCK + p for b, ps in zip(block_ids, positions, strict=True) for p in ps]
    attn = AttentionMetadata.build(
        kv_caches=kv_caches,
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=[ps[-1] + 1 for ps in positions],
        block_table=torch.tensor([[b] for b in block_ids]),
        block_size=BLOCK,
        dtype=dtype,
        backend=backend,
    )
    with torch.inference_mode():
        return model(
            torch.tensor([t for ts in tokens for t in ts]),  # [T]
            torch.tensor([p for ps in positions for p in ps]),  # [T]
            attn,
            torch.tensor(starts[1:]) - 1,  # [S]
        )


def _prefill_then_decode(model: ModelForward, config: ModelConfig) -> list[torch.Tensor]:
    dtype = getattr(torch, config.dtype)
    shape = (2, config.num_kv_heads, 4, BLOCK, config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
    backend = config.attention_backend
    prompts = [[5, 9, 13, 200, 7], [40, 41, 42]]
    prefill = _step(model, caches, backend, dtype, [[0, 1, 2, 3, 4], [0, 1, 2]], [2, 0], prompts)
    # The decode reads the keys and values the prefill wrote into the cache.
    decode = _step(model, caches, backend, dtype, [[5], [3]], [2, 0], [[11], [12]])
    return [prefill, decode]


@pytest.mark.timeout(120)
def test_every_forward_takes_a_step_alike(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_factory("qwen3")  # qwen3: per-head q/k norms too
    config = _config(model_dir, dtype="bfloat16")
    from_checkpoint = load_model_forward(config, CPU)
    assert isinstance(from_checkpoint, CpuForward)
    want = _prefill_then_decode(from_checkpoint, config)
    assert [t.shape for t in want] == [(2, config.vocab_size)] * 2
    assert all(t.dtype == torch.bfloat16 for t in want)
    monkeypatch.setattr(cpu_checkpoint, "lean_checkpoint_reason", lambda config: "switched off")
    over_transformers = load_model_forward(config, CPU)
    assert isinstance(over_transformers, CpuForward)
    assert _same_bits(_prefill_then_decode(over_transformers, config), want)
    # transformers' own forward, on the "cpu" backend with the native ops: the same bits.
    monkeypatch.setattr("asyncengine.model.cpu_forward.unsupported_reason", lambda m: "off")
    transformers_forward = load_model_forward(config, CPU)
    assert isinstance(transformers_forward, TransformersModel)
    assert _same_bits(_prefill_then_decode(transformers_forward, config), want)
    # ... and on the torch reference attention: the same up to its summation order.
    torch_config = _config(model_dir, dtype="bfloat16", attention_backend="torch")
    reference = load_model_forward(torch_config, CPU)
    assert isinstance(reference, TransformersModel)
    for a, b in zip(_prefill_then_decode(reference, torch_config), want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)


def _same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
