"""`quantization="int8"`: a Hugging Face checkpoint's linear weights quantized at load, per
output channel and symmetric, onto the Q8_0 kernels (model/quant_linear.py, cpu_checkpoint.py).

The reference is transformers in fp32 over the same int8 weights dequantized, with every
linear layer's input rows rounded as the int8 kernels round them (`quantize_rows_q8_torch`),
so the two differ only in the order of fp32 sums and greedy tokens are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.kernels.quant_cpu import dequantize_rows_q8, quantize_rows_q8_torch
from asyncengine.kernels.quant_formats import dequantize
from asyncengine.model.cpu_checkpoint import load_cpu_forward
from asyncengine.model.quant_linear import QuantLinear, quantize_int8_per_channel
from asyncengine.testing.models import TINY_ARCHITECTURES
from asyncengine.testing.reference import greedy_generate

pytestmark = [
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
    pytest.mark.timeout(300),
]

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100], [7] * 30]


def test_per_channel_quantization_is_one_symmetric_scale_per_row() -> None:
    torch.manual_seed(0)
    w = torch.randn(5, 96) * torch.tensor([[0.1], [1.0], [3.0], [0.0], [0.02]])
    w[1, 17] = -4.0  # the row's largest magnitude is negative: it maps to -127
    q = quantize_int8_per_channel(w)
    assert q.dtype == torch.uint8 and q.shape == (5, 96 // 32 * 34)
    blocks = q.view(5, 3, 34)
    scales = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # [5, 3]
    assert torch.equal(scales, scales[:, :1].expand(5, 3))  # every block: the row's scale
    want = (w.abs().amax(1) / 127).half().float()
    assert torch.equal(scales[:, 0], want)
    ints = blocks[..., 2:].contiguous().view(torch.int8).reshape(5, 96)
    assert int(ints[1, 17]) == -127 and int(ints.abs().max()) == 127
    assert torch.all(ints[3] == 0) and scales[3, 0] == 0  # a zero row
    back = dequantize(q, "q8_0")
    assert torch.all((back - w).abs() <= want[:, None] / 2 * (1 + 1e-3))


def test_a_weight_whose_k_is_not_a_multiple_of_32_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8_per_channel(torch.randn(4, 48))


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens over the int8 weights dequantized, inputs rounded."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()

    def round_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
        rows = args[0].reshape(-1, args[0].shape[-1])
        return (dequantize_rows_q8(*quantize_rows_q8_torch(rows)).view(args[0].shape),)

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = module.weight
                w.copy_(dequantize(quantize_int8_per_channel(w), "q8_0"))
                module.register_forward_pre_hook(round_input)
    return greedy_generate(model, prompts, NEW_TOKENS)


def _greedy(model: Path, **config: Any) -> list[list[int]]:
    llm = LLM(model, device="cpu", dtype="float32", **config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_tokens_equal_the_int8_reference(
    tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    model = tiny_model_factory(arch)
    # Steps of up to 15 tokens: from 16 rows on the products run on the dequantized weight
    # (quant_linear.DEQUANT_MIN_ROWS_BY_BLOCK), without the int8 rounding the reference does.
    got = _greedy(model, quantization="int8", max_num_batched_tokens=15)
    assert got == _reference(model, PROMPTS)


def test_the_projections_are_int8_and_the_rest_is_not(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory("qwen2")  # q/k/v biases
    config = EngineConfig.from_kwargs(model, device="cpu", dtype="bfloat16", quantization="int8")
    forward = load_cpu_forward(config.model_config)
    linears = forward.linear_layers()
    head = linears[-1]
    assert not isinstance(head, QuantLinear)  # the lm_head stays packed bf16 for its screen
    projections = linears[:-1]
    assert projections and all(isinstance(m, QuantLinear) for m in projections)
    # Q8_0 blocks, on AVX512-VNNI with their rows 8 at a time interleaved (decode_layout)
    assert all(m.qtype in ("q8_0", "q8_0_r8") for m in projections)  # type: ignore[union-attr]
    assert any(m.bias is not None for m in projections)  # type: ignore[union-attr]
    plain = load_cpu_forward(EngineConfig.from_kwargs(model, device="cpu").model_config)
    assert not any(isinstance(m, QuantLinear) for m in plain.linear_layers())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantization": "int4"}, r"quantization='int4' is invalid: one of None, 'int8'"),
        ({"quantization": "int8", "attention_backend": "torch"}, "runs on the CPU"),
        ({"quantization": "int8", "tensor_parallel_size": 2}, "tensor parallelism"),
    ],
)
def test_bad_quantization_settings_are_refused(
    tiny_llama: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(tiny_llama, device="cpu", **kwargs)


def test_quantization_of_a_gguf_file_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from test_gguf_files import Q, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", weight_type=Q.Q8_0).path
    with pytest.raises(ValueError, match="GGUF file, whose weights are quantized already"):
        LLM(path, device="cpu", quantization="int8")


def test_a_checkpoint_the_lean_loader_does_not_take_is_refused(tmp_path: Path) -> None:
    import json

    from asyncengine.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "gelu", "llama")
    config = json.loads((model / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"runs on the lean CPU forward only .*'gelu'"):
        LLM(model, device="cpu", quantization="int8")
