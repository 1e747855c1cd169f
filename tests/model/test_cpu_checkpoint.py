"""The lean CPU loader (`model/cpu_checkpoint.py`) and its rotary tables (`model/rope.py`).

Its contract: the model it builds straight from the checkpoint gives transformers' numbers (the
engine's tokens and logprobs, bit for bit) without importing transformers, and it keeps none of
the checkpoint's file mapped. Checkpoints it does not take load through transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.kernels.cpu_native import load_native, unavailable_reason
from asyncengine.model import cpu_checkpoint
from asyncengine.model.rope import RopeSpec, RotaryEmbedding
from asyncengine.testing.models import build_tiny_model
from asyncengine.testing.reference import engine_tokens_and_logprobs

pytestmark = [
    pytest.mark.skipif(load_native() is None, reason=unavailable_reason()),
    pytest.mark.timeout(300),
]

REPO_ROOT = Path(__file__).resolve().parents[2]

_ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    hf = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    path.write_text(json.dumps(hf))


@pytest.mark.parametrize("rope", sorted(_ROPES))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rotary_tables_are_transformers_tables(rope: str, arch: str, tmp_path: Path) -> None:
    import transformers

    overrides = dict(_ROPES[rope])
    if arch == "qwen3":  # an explicit head_dim other than hidden / heads
        overrides["head_dim"] = 24
    model_dir = build_tiny_model(tmp_path, arch, **overrides)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    module = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    hf = json.loads((model_dir / "config.json").read_text())
    head_dim = config.head_dim
    ours = RotaryEmbedding(RopeSpec.from_hf_config(hf, head_dim))
    assert torch.equal(ours.inv_freq, module.inv_freq)
    positions = torch.arange(0, 3000, 7)[None]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        want, got = module(x, positions), ours(x, positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # the lean forward's lookup: rows of tables of the same numbers, grown on demand
        rows = ours.rows(positions[0], dtype)
        assert torch.equal(rows[0], want[0][0]) and torch.equal(rows[1], want[1][0])
        # past the first table (it grows), and past the largest one (computed as they come)
        for far in (torch.tensor([9000, 3, 17_000]), torch.tensor([40_000, 5])):
            rows = ours.rows(far, dtype)
            want = module(x, far[None])
            assert torch.equal(rows[0], want[0][0]) and torch.equal(rows[1], want[1][0])


def test_legacy_rope_settings_resolve_as_transformers_resolves_them(tmp_path: Path) -> None:
    """An older config.json: rope_theta at the top, the scaling in `rope_scaling` with `type`."""
    import transformers

    model_dir = build_tiny_model(tmp_path, "llama")
    _edit_config(
        model_dir,
        rope_parameters=None,
        rope_theta=20_000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    config = transformers.AutoConfig.from_pretrained(model_dir)
    module = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    hf = json.loads((model_dir / "config.json").read_text())
    spec = RopeSpec.from_hf_config(hf, config.head_dim)
    assert (spec.rope_type, spec.theta) == ("linear", 20_000.0)
    assert torch.equal(spec.inv_freq(), module.inv_freq)


def test_rope_types_it_does_not_compute_are_refused() -> None:
    for params, match in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "linear"}}, "factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ]:
        with pytest.raises(ValueError, match=match):
            RopeSpec.from_hf_config(params, 32)


def _run(model_dir: Path, dtype: str) -> list[tuple[list[int], list[list[float]]]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[7], list(range(20, 70)), [300, 301, 5, 9]]
    return engine_tokens_and_logprobs(
        model_dir, prompts, params, dtype=dtype, max_num_batched_tokens=32, num_kv_blocks=32
    )


@pytest.mark.parametrize(
    "case",
    ["tied-llama3-fp32-file", "sharded-qwen2-bf16-file", "llama-attention-and-mlp-bias"],
)
def test_checkpoints_load_to_transformers_numbers(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoint shapes the tiny-architecture test does not cover: tied embeddings, llama3
    rope, an fp32 file cast to bf16, a sharded file, Llama's optional biases."""
    import transformers

    arch = "qwen2" if case.startswith("sharded") else "llama"
    overrides: dict[str, Any] = {}
    if case.startswith("tied"):
        overrides = {"tie_word_embeddings": True, **_ROPES["llama3"]}
    if case.startswith("llama-attention"):
        overrides = {"attention_bias": True, "mlp_bias": True}
    model_dir = build_tiny_model(
        tmp_path / "m", arch, dtype="bfloat16" if "bf16" in case else "float32", **overrides
    )
    if case.startswith(("sharded", "llama-attention")):  # biases and norms that are not 0 / 1
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
        shard = "200KB" if case.startswith("sharded") else "1GB"
        (model_dir / "model.safetensors").unlink()  # transformers would read it first
        model.save_pretrained(model_dir, max_shard_size=shard)
    if case.startswith("sharded"):
        assert (model_dir / "model.safetensors.index.json").is_file()
    config = EngineConfig.from_kwargs(str(model_dir), device="cpu").model_config
    assert cpu_checkpoint.lean_checkpoint_reason(config) is None
    if case.startswith("tied"):  # the lookup reads the lm_head's packed weight, where it can
        bf16 = EngineConfig.from_kwargs(str(model_dir), device="cpu", dtype="bfloat16").model_config
        forward = cpu_checkpoint.load_cpu_forward(bf16)
        # PackedLinear's native copy (AVX512-BF16); None for the AVX2 dense kernel's layer
        native = getattr(forward._lm_head, "native", None)
        assert (forward._embed_rows is not None) == (native is not None)
        assert (forward._embed_weight is None) == (native is not None)
    lean = _run(model_dir, "bfloat16")
    monkeypatch.setattr(cpu_checkpoint, "lean_checkpoint_reason", lambda config: "switched off")
    assert _run(model_dir, "bfloat16") == lean


def test_checkpoints_it_does_not_take_load_through_transformers(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    def reason(model_dir: Path, **kwargs: Any) -> str | None:
        config = EngineConfig.from_kwargs(str(model_dir), device="cpu", **kwargs).model_config
        return cpu_checkpoint.lean_checkpoint_reason(config)

    assert reason(tiny_model_factory("llama")) is None
    assert "silu" in (reason(tiny_model_factory("llama", hidden_act="gelu")) or "")
    assert "backend" in (reason(tiny_model_factory("llama"), attention_backend="torch") or "")
    yarn = build_tiny_model(
        tmp_path / "yarn",
        "llama",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 2.0},
    )
    assert "yarn" in (reason(yarn) or "")
    # A tensor missing from the checkpoint: transformers decides what that means.
    from safetensors.torch import load_file, save_file

    missing = build_tiny_model(tmp_path / "missing", "llama")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    assert "up_proj" in (reason(missing) or "")
    # A config.json whose head size does not fit the tensors, or a quantised checkpoint.
    wrong = build_tiny_model(tmp_path / "wrong", "llama")
    _edit_config(wrong, head_dim=8)
    assert "q_proj" in (reason(wrong) or "")
    quantised = build_tiny_model(tmp_path / "quantised", "llama")
    _edit_config(quantised, quantization_config={"quant_method": "fp8"})
    assert "quantized" in (reason(quantised) or "")
    # Such a model still runs (through transformers' loading).
    llm = LLM(yarn, device="cpu", dtype="float32")
    try:
        runner = llm.engine.engine_core.executor.worker.model_runner  # type: ignore[attr-defined]
        # Loaded by transformers (and then run by whichever forward takes it).
        assert "transformers.modeling_utils" in sys.modules and runner.model is not None
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


_NO_TRANSFORMERS = """
import json, sys
sys.path.insert(0, {root!r})
from asyncengine import LLM, SamplingParams

llm = LLM({model!r}, device="cpu", dtype="bfloat16", num_kv_blocks=8)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
runner = llm.engine.engine_core.executor.worker.model_runner
maps = open("/proc/self/maps").read()
print(json.dumps({{
    "tokens": len(out[0].outputs[0].token_ids),
    "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
    "lean": type(runner.model).__name__ == "CpuForward",
    "file_mapped": "model.safetensors" in maps,
}}))
llm.shutdown()
"""


def test_the_lean_loader_imports_no_transformers_and_unmaps_the_file(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """In a fresh interpreter, as an application starts: the engine serves without importing
    transformers, and the checkpoint's file is not left mapped (resident) once loaded."""
    script = _NO_TRANSFORMERS.format(root=str(REPO_ROOT), model=str(tiny_model_factory("qwen3")))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=200
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"tokens": 3, "transformers": [], "lean": True, "file_mapped": False}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_bf16_weights_without_packing_leave_no_file_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU whose oneDNN lacks bf16: the weights are plain (and joined), all of them copies."""
    import gc

    from asyncengine.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "_PACKABLE", ())
    model_dir = build_tiny_model(tmp_path / "m", "llama", dtype="bfloat16")
    config = EngineConfig.from_kwargs(str(model_dir), device="cpu", dtype="bfloat16").model_config
    forward = cpu_checkpoint.load_cpu_forward(config)
    gc.collect()
    plain = (cpu_linear.DenseLinear, cpu_linear.NativeDenseLinear)  # (AVX2: packed, a copy)
    assert all(isinstance(m, plain) for m in forward.linear_layers())
    assert str(model_dir / "model.safetensors") not in Path("/proc/self/maps").read_text()


def _mapping_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (its resolved name), from smaps."""
    name, total, inside = str(path.resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == name
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_release_drops_the_pages_read_through_a_symlinked_folder(tmp_path: Path) -> None:
    """/proc/self/maps names the file by its resolved path: a model folder given through a
    symlink (or a relative path) must still have its read pages dropped."""
    from contextlib import ExitStack

    from safetensors.torch import save_file

    (tmp_path / "real").mkdir()
    save_file({"w": torch.ones(1024, 1024)}, str(tmp_path / "real" / "model.safetensors"))
    (tmp_path / "link").symlink_to(tmp_path / "real")
    path = tmp_path / "link" / "model.safetensors"
    with ExitStack() as stack:
        tensors = cpu_checkpoint._Tensors({"w": path}, stack)
        assert tensors.read("w").sum().item() == 1024 * 1024  # every page read
        assert _mapping_rss_kb(path) >= 3 * 1024
        tensors.release()
        assert _mapping_rss_kb(path) < 256


def test_a_tied_table_without_packing_is_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without oneDNN's bf16 packing or the native dense kernel, the lm_head is a plain
    product over a copy of the table: the lookup reads that same copy, not a second one."""
    from asyncengine.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "_PACKABLE", ())
    monkeypatch.setattr(cpu_linear, "_dense_native", lambda weight: False)
    model_dir = build_tiny_model(
        tmp_path / "m", "llama", dtype="bfloat16", tie_word_embeddings=True
    )
    config = EngineConfig.from_kwargs(str(model_dir), device="cpu", dtype="bfloat16").model_config
    forward = cpu_checkpoint.load_cpu_forward(config)
    lm_head = forward._lm_head  # type: ignore[attr-defined]
    table = forward._embed_weight  # type: ignore[attr-defined]
    assert isinstance(lm_head, cpu_linear.DenseLinear)
    assert table is not None and table.data_ptr() == lm_head.weight.data_ptr()
