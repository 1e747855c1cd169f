"""Llama-style RMSNorm modules routed through the Triton kernel give transformers' logits: on a
GPU (compiled; marked `gpu`) where there is one, else on the CPU (under Triton's interpreter)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine.model.fused_ops import use_triton_rms_norm

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3 also normalises q and k per head
def test_triton_rms_norm_keeps_the_logits(
    arch: str, device: str, tiny_model_factory: Callable[..., Path]
) -> None:
    from transformers import AutoModelForCausalLM

    on = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32)
    model = model.to(on).eval()
    ids = torch.randint(4, 500, (2, 11), generator=torch.Generator().manual_seed(0)).to(on)
    with torch.inference_mode():
        expected = model(ids).logits
        layers = model.config.num_hidden_layers
        switched = use_triton_rms_norm(model, on)
        got = model(ids).logits
    # Two norms per layer and the final one; qwen3 adds its q and k norms.
    assert switched == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
