"""LoRA in the native decode call (model/decode_layers.py with csrc/lora.c): a bf16 step whose
rows use adapters stays on the one native call, and its tokens are the Python loop's, for a
batch mixing adapters and the base model: to the bit where the loop adds the deltas with the
same kernel, up to near ties where it adds them with the torch reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# The autouse fixture that runs each test with the bf16 layers on the AVX2 dense kernel and on
# linear.c's packed blocks.
from test_decode_layers import route  # noqa: F401

from asyncengine import LLM, LoRARequest, SamplingParams
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.model import decode_layers, lora_layers
from asyncengine.testing.lora import build_peft_adapter

pytestmark = [
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
    pytest.mark.timeout(300),
]

ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, seed=1),
    "mlp": dict(target_modules=["gate_proj", "up_proj", "down_proj"], rank=16, seed=2),
    "qv": dict(target_modules=["q_proj", "v_proj"], rank=64, seed=3),  # k left out
}


Run = list[tuple[list[int], list[float]]]


def _run(model: Path, adapters: dict[str, Path], names: list[str | None]) -> Run:
    """Greedy tokens of one prompt per entry of `names` (its adapter, or None), all at once,
    each with its steps' margins: the logprob of the top token less the runner-up's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 500, (3 + 7 * i,), generator=g).tolist() for i in range(len(names))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(
        model, device="cpu", dtype="bfloat16", enable_lora=True, max_loras=len(adapters),
        max_lora_rank=64, max_num_batched_tokens=32, num_kv_blocks=64,
    )  # fmt: skip
    try:
        for name, path in adapters.items():
            llm.add_lora(LoRARequest(name, path))
        loras = [None if n is None else LoRARequest(n) for n in names]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # type: ignore[arg-type]
        runs = []
        for out in outs:
            steps = out.outputs[0].logprobs
            assert steps is not None
            top = [sorted((v.logprob for v in step.values()), reverse=True) for step in steps]
            runs.append((list(out.outputs[0].token_ids), [t[0] - t[1] for t in top]))
        return runs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_lora_steps_give_the_python_loops_tokens(
    arch: str,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model_factory(arch)
    adapters = {n: build_peft_adapter(model, tmp_path / n, **kw) for n, kw in ADAPTERS.items()}
    names: list[str | None] = ["attn", None, "mlp", "qv", "attn", None, "mlp"]
    steps = {"lora": 0, "base": 0, "declined": 0}
    real = decode_layers.NativeDecodeLayers.__call__

    def spy(layers: Any, residual: torch.Tensor, *args: Any) -> torch.Tensor | None:
        out = real(layers, residual, *args)
        lora = args[3] if len(args) > 3 else None
        steps["declined" if out is None else "base" if lora is None else "lora"] += 1
        return out

    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "__call__", spy)
    native = _run(model, adapters, names)
    assert steps["lora"] > 10 and steps["declined"] == 0
    monkeypatch.setattr(decode_layers.NativeDecodeLayers, "build", lambda *a: None)
    assert _run(model, adapters, names) == native  # the loop, the kernel in it
    monkeypatch.setattr(lora_layers, "NATIVE_IN_LOOP", False)
    loop = _run(model, adapters, names)  # the loop, the torch reference in it
    # The deltas' fp32 sums run in another order than torch's, so a bf16 delta may differ in
    # its last bit: the tokens are the same up to a step where the loop's top two were close.
    for (tokens, _), (want, margins) in zip(native, loop, strict=True):
        diff = [i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b]
        same = diff[0] if diff else len(want)
        assert same == len(want) or margins[same] < 0.05, (tokens, want, margins)
    assert sum(n[0] == lo[0] for n, lo in zip(native, loop, strict=True)) >= len(names) - 2
