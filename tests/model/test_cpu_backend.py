"""The "cpu" backend (native kernels) through the whole engine, and its fused ops in models.

On a CPU device `attention_backend="auto"` means "cpu": greedy tokens must equal transformers'
(fp32) with every attention path in play, and the fused RMSNorm / SiLU-and-multiply must keep
the model's logits. Where the kernels can't be built the backend is the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.kernels import cpu_native
from asyncengine.model import attention
from asyncengine.model.attention import AttentionBackend, get_backend
from asyncengine.model.fused_ops import use_native_cpu_ops
from asyncengine.testing import transformers_greedy

pytestmark = pytest.mark.skipif(
    cpu_native.load_native() is None, reason=cpu_native.unavailable_reason()
)

CPU = torch.device("cpu")
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(4, 500, (40,), generator=g).tolist()
    tails = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (1, 5, 37)]
    return [[9], shared + tails[0], shared + tails[1], shared + tails[2], tails[2]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_auto_on_cpu_uses_native_kernels_and_matches_transformers(
    arch: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []

    def spy(name: str, device: torch.device) -> AttentionBackend:
        backend = get_backend(name, device)
        used.append(backend.name)
        return backend

    monkeypatch.setattr(attention, "get_backend", spy)
    model_dir = tiny_model_factory(arch)
    expected = transformers_greedy(model_dir, _prompts(), NEW_TOKENS)
    # A small token budget splits the long prompts into chunks over a cached prefix; the
    # second pass hits the prefix cache; decodes run next to prefills.
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=24, num_kv_blocks=40)
    for _ in range(2):
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert set(used) == {"cpu"}
    assert llm.statistics().prefix_cache_hits > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3 also normalises q and k per head
def test_fused_ops_keep_the_logits(arch: str, tiny_model_factory: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32)
    model.eval()
    ids = torch.randint(4, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits
        layers = model.config.num_hidden_layers
        norms, mlps = use_native_cpu_ops(model)
        got = model(ids).logits
    assert norms == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert mlps == layers
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(cpu_native.DISABLE_ENV, "0")
    cpu_native.load_native.cache_clear()
    attention._cpu_backend.cache_clear()
    yield
    cpu_native.load_native.cache_clear()
    attention._cpu_backend.cache_clear()


@pytest.mark.usefixtures("no_native")
def test_without_native_kernels_cpu_is_the_torch_reference() -> None:
    assert get_backend("cpu", CPU).name == "torch"
    assert use_native_cpu_ops(torch.nn.Linear(2, 2)) == (0, 0)


def test_cpu_backend_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on CPU devices only"):
        get_backend("cpu", torch.device("cuda"))


def test_config_resolves_and_checks_the_cpu_backend(tiny_llama: Path) -> None:
    from asyncengine.config import EngineConfig

    auto = EngineConfig.from_kwargs(tiny_llama, device="cpu")
    assert auto.model_config.attention_backend == "cpu"
    explicit = EngineConfig.from_kwargs(tiny_llama, device="cpu", attention_backend="torch")
    assert explicit.model_config.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on CPU devices only"):
        EngineConfig.from_kwargs(tiny_llama, device="cuda", attention_backend="cpu")
