"""A GGUF file is a model: `LLM` / `AsyncLLM` / the CLI run tiny GGUF files of float weights and
of every quantized type the engine runs (a Q4_K_M-like mix too) on the CPU, with the config,
tokenizer and name from the file.

The reference is transformers in fp32 over the same weights (the file's blocks dequantized, q/k
rows in HF order). For quantized files the engine quantizes each linear layer's input rows to
int8 blocks of 32 (as llama.cpp does), so the reference does the same to every linear layer's
input (`quantize_rows_q8_torch`, bit for bit the kernels' activation rounding); the two then
differ only in the order of fp32 sums. Greedy tokens are equal, except that at a near-tie of
the reference's two best tokens (the int8 rounding of a row can turn a last-bit difference
into a ~1e-3 gap) the engine may take the other one; the comparison ends there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asyncengine import LLM, AsyncLLM, SamplingParams
from asyncengine.gguf import GGUFError, read_gguf
from asyncengine.gguf.serving import served_model_name, tokenizer_folder
from asyncengine.paths import cache_dir
from asyncengine.testing.reference import greedy_generate

gguf = pytest.importorskip("gguf")
from test_gguf_files import Q, Shapes, expected_values, write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100], [7] * 40]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tokenizer folders in a temporary cache; the native kernels from the usual one."""
    real = cache_dir()
    cache = tmp_path_factory.getbasetemp() / "gguf-engine-cache"
    if not cache.exists():
        cache.mkdir()
        (real / "native").mkdir(parents=True, exist_ok=True)
        (cache / "native").symlink_to(real / "native")
    old = os.environ.get("ASYNCENGINE_CACHE")
    os.environ["ASYNCENGINE_CACHE"] = str(cache)
    yield
    if old is None:
        del os.environ["ASYNCENGINE_CACHE"]
    else:
        os.environ["ASYNCENGINE_CACHE"] = old


def _reference(
    path: Path,
    tiny: Any,
    prompts: list[list[int]],
    quantized: bool,
    freq_factors: np.ndarray | None = None,
) -> list[list[int]]:
    """transformers' greedy tokens over the file's weights dequantized to fp32; with
    `quantized`, every linear layer's input rows rounded as the int8 kernels round them;
    with `freq_factors`, the rotary inverse frequencies divided by them."""
    model = _reference_model(path, tiny, quantized, freq_factors)
    return greedy_generate(model, prompts, NEW_TOKENS)


# A reference step whose two best tokens' logprobs are closer than this is a near-tie: the
# int8 rounding of activations turns fp32 sum-order differences into gaps of ~1e-3 there
# (measured on these tiny random models), so the engine may take either token.
NEAR_TIE = 0.02


def _assert_greedy_matches(got: list[list[int]], model: Any, prompts: list[list[int]]) -> None:
    """The engine's greedy tokens equal the reference's, or part from them first at a step
    where the reference's top two tokens are a near-tie (after which nothing is compared)."""
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for step, token in enumerate(tokens):
                logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
                top = logprobs.topk(2)
                best = int(top.indices[0])
                if token != best:
                    gap = float(top.values[0] - logprobs[token])
                    assert gap < NEAR_TIE, (prompt, step, token, best, gap)
                    break
                ids = torch.cat([ids, torch.tensor([[best]])], dim=1)


def _reference_model(
    path: Path, tiny: Any, quantized: bool, freq_factors: np.ndarray | None = None
) -> Any:
    """The transformers model `_reference` runs (see there)."""
    import transformers

    from asyncengine.kernels.quant_cpu import (
        QK,
        activation_group,
        dequantize_rows_q8,
        quantize_rows_q8_torch,
    )

    model_file = read_gguf(path)
    hf = dict(model_file.hf_config)
    model_file.close()
    hf.pop("architectures")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model: Any = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    state = {name: torch.from_numpy(expected_values(tiny, name)) for name in tiny.weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    if freq_factors is not None:
        rotary = model.model.rotary_emb
        rotary.inv_freq = rotary.inv_freq / torch.from_numpy(freq_factors)
    if quantized:

        def round_input(group: int) -> Any:
            def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
                x = args[0]
                rows = x.reshape(-1, x.shape[-1])
                return (dequantize_rows_q8(*quantize_rows_q8_torch(rows, group)).view(x.shape),)

            return hook

        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                # each layer's activations rounded as its GGUF type's products round them
                ggml_type = tiny.types.get(f"{name}.weight")
                if ggml_type is None:  # a tied lm_head: the embedding's type
                    ggml_type = tiny.types.get("model.embed_tokens.weight")
                group = QK if ggml_type is None else activation_group(Q(ggml_type).name.lower())
                module.register_forward_pre_hook(round_input(group))
    return model


def _assert_free(llm: LLM) -> None:
    stats = llm.statistics()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def _greedy(model: Path, **config: Any) -> list[list[int]]:
    llm = LLM(model, device="cpu", dtype="float32", **config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _assert_free(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


CASES = [
    ("llama", Q.F32),  # float weights: the packed/dense path, q/k rows un-permuted
    ("qwen2", Q.F16),
    ("qwen3", Q.BF16),
    ("llama", Q.Q8_0),  # q/k blocks permuted back to HF order
    ("llama", Q.Q4_0),
    ("qwen2", Q.Q8_0),  # q/k/v biases on quantized projections
    ("qwen3", Q.Q4_0),  # q/k norms
    ("mistral", Q.Q8_0),
    ("llama", Q.Q4_1),
    ("qwen2", Q.Q5_0),
    ("qwen3", Q.Q5_1),
    ("llama", Q.Q4_K),  # K-quants: rows of whole 256-value super-blocks
    ("qwen2", Q.Q5_K),
    ("mistral", Q.Q6_K),
]
# K-quant rows are whole super-blocks of 256 values: every K of the model a multiple of 256
K_SHAPES = Shapes(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64)


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_greedy_tokens_follow_the_dequantized_reference(
    tmp_path: Path, arch: str, qtype: Q
) -> None:
    shapes = K_SHAPES if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else None
    tiny = write_tiny_gguf(
        tmp_path / f"{arch}.gguf", arch, weight_type=qtype, seed=3, shapes=shapes
    )
    quantized = qtype not in (Q.F32, Q.F16, Q.BF16)
    model = _reference_model(tiny.path, tiny, quantized)
    _assert_greedy_matches(_greedy(tiny.path), model, PROMPTS)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_long_prefill_gives_its_routes_reference_logprobs(tmp_path: Path, qtype: Q) -> None:
    # One step of at least DEQUANT_MIN_ROWS tokens. On the scalar path (no panel GEMM) the
    # projections multiply the dequantized weight with the float GEMM: the prompt's logprobs
    # are the unrounded fp32 reference's up to the order of sums; so on the AVX2 path for
    # Q8_0, whose many-row products multiply in fp32 (csrc/quant_gemm_f32.c). Otherwise on the
    # AVX512-VNNI and AVX2 paths every projection runs an int8 panel GEMM, its input rows
    # rounded to int8 blocks as in short steps: close to the reference that rounds them too,
    # where a sum's order can move a value across a rounding step of its block (so 1e-2, not
    # 1e-4).
    from asyncengine.kernels import quant_cpu
    from asyncengine.model.quant_linear import DEQUANT_MIN_ROWS

    tiny = write_tiny_gguf(tmp_path / "long.gguf", "llama", weight_type=qtype, seed=5,
                           shapes=K_SHAPES)  # fmt: skip
    prompt = [3 + (11 * i) % 200 for i in range(DEQUANT_MIN_ROWS + 16)]
    name = qtype.name.lower()
    try:
        for path in quant_cpu.available_paths():
            quant_cpu.set_path(path)
            assert (quant_cpu.gemm_min_rows(name) > 0) == (path != "scalar")
            rounded = path != "scalar" and quant_cpu.gemm_f32_min_rows(name) == 0
            model = _reference_model(tiny.path, tiny, quantized=rounded)
            with torch.inference_mode():
                logits = model(torch.tensor([prompt])).logits[0].float()
            reference = torch.log_softmax(logits, dim=-1)
            llm = LLM(tiny.path, device="cpu", dtype="float32", max_num_batched_tokens=256)
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.prompt_logprobs is not None
            for p in range(1, len(prompt)):
                got = out.prompt_logprobs[p]
                assert got is not None
                want = reference[p - 1, prompt[p]].item()
                tolerance = 1e-2 if rounded else 1e-4
                assert got[prompt[p]].logprob == pytest.approx(want, abs=tolerance), (path, p)
            _assert_free(llm)
            llm.shutdown()
    finally:
        quant_cpu.set_path(None)


def test_a_q4_k_m_like_mix_of_types_runs(tmp_path: Path) -> None:
    """What llama-quantize writes for Q4_K_M: Q4_K projections, some Q6_K ones (half the
    down projections and the v projections), a Q6_K embedding (tied: the lm_head too)."""
    mix = {"v_proj": Q.Q6_K, "layers.0.mlp.down_proj": Q.Q6_K}
    tiny = write_tiny_gguf(
        tmp_path / "mix.gguf", "llama", weight_type=Q.Q4_K, embed_type=Q.Q6_K, tied=True,
        shapes=K_SHAPES, seed=5, type_overrides=mix,
    )  # fmt: skip
    assert {tiny.types[n] for n in tiny.weights if n.endswith("proj.weight")} == {Q.Q4_K, Q.Q6_K}
    _assert_greedy_matches(_greedy(tiny.path), _reference_model(tiny.path, tiny, True), PROMPTS)


def test_quantized_weights_stay_quantized_and_tied_lm_head_gives_logits(tmp_path: Path) -> None:
    from asyncengine.config import EngineConfig
    from asyncengine.kernels.lm_head_argmax_cpu import ARGMAX_MAX_ROWS
    from asyncengine.model.gguf_checkpoint import load_gguf_forward
    from asyncengine.model.quant_linear import QuantEmbedding, QuantLinear

    tiny = write_tiny_gguf(tmp_path / "t.gguf", "llama", weight_type=Q.Q8_0, tied=True)
    config = EngineConfig.from_kwargs(tiny.path, device="cpu", dtype="bfloat16")
    forward = load_gguf_forward(config.model_config)
    linears = forward.linear_layers()
    assert all(isinstance(m, QuantLinear) for m in linears)
    assert all(m.qweight.dtype == torch.uint8 for m in linears)  # type: ignore[union-attr]
    assert isinstance(forward._embed_rows, QuantEmbedding)
    # The layers run in the one native call; the quantized lm_head has no screen, but a
    # step of a few rows picks its tokens from the logits itself (cpu_forward.pick_tokens).
    assert forward.native_layers is not None and forward.lm_head_argmax is None
    assert forward.token_choice_rows == ARGMAX_MAX_ROWS
    # The unpermuted projections read the file's mapping in place, or on AVX512-VNNI its rows
    # 8 at a time interleaved (quant_cpu.decode_layout), the same bytes.
    from asyncengine.kernels import quant_cpu

    o_proj = forward._layers[0].o_proj
    assert isinstance(o_proj, QuantLinear)
    mapped = np.frombuffer(
        read_gguf(tiny.path).tensors["model.layers.0.self_attn.o_proj.weight"].data(),
        dtype=np.uint8,
    )
    qweight = o_proj.qweight
    if quant_cpu.current_path() == "avx512_vnni":
        assert o_proj.qtype == quant_cpu.Q8_0_R8
        qweight = quant_cpu.unpack_r8(qweight, o_proj.qtype)
    assert qweight.numpy().tobytes() == mapped.tobytes()


def test_a_folder_with_one_gguf_is_that_model(tmp_path: Path) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    tiny = write_tiny_gguf(folder / "Tiny-Q8_0.gguf", "qwen2", weight_type=Q.Q8_0, seed=3)
    llm = LLM(folder, device="cpu", dtype="float32")
    assert llm.engine.config.model_config.model == str(tiny.path)
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(
        tiny.path, tiny, PROMPTS[:2], quantized=True
    )
    assert served_model_name(llm.engine.config.model_config.model) == "Tiny-Q8_0"
    # The tokenizer and its chat template come from the file.
    text = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer_folder(tiny.path) / "tokenizer.json").is_file()


def test_a_folder_of_several_gguf_files_asks_which(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        write_tiny_gguf(tmp_path / name, "llama")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): name one"):
        LLM(tmp_path, device="cpu")


@pytest.mark.anyio
async def test_async_llm_runs_a_gguf_file(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "a.gguf", "llama", weight_type=Q.Q4_0, seed=3)
    want = await anyio.to_thread.run_sync(_reference, tiny.path, tiny, PROMPTS[:2], True)
    engine = AsyncLLM.from_pretrained(tiny.path, device="cpu", dtype="float32", core="thread")
    async with engine:
        got = []
        for prompt in PROMPTS[:2]:
            final = None
            async for out in engine.generate(prompt, GREEDY):
                final = out
            assert final is not None
            got.append(list(final.outputs[0].token_ids))
    assert got == want


def test_cli_generate_runs_a_gguf_file(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "cli.gguf", "llama", weight_type=Q.Q8_0)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncengine.entrypoints.cli", "generate", str(tiny.path), "Hello",
         "--device", "cpu", "--max-tokens", "4", "--temperature", "0"],
        capture_output=True, text=True, timeout=100, env=os.environ.copy(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cli_refuses_an_unsupported_type_in_one_line(tmp_path: Path) -> None:
    raw = np.zeros((8, 84), dtype=np.uint8)  # rows of one Q2_K super-block (256 values)
    path = write_tiny_gguf(
        tmp_path / "q2k.gguf", "llama", extra_tensors={"blk.0.attn_q.weight.x": (raw, Q.Q2_K)}
    ).path
    proc = subprocess.run(
        [sys.executable, "-m", "asyncengine.entrypoints.cli", "generate", str(path), "Hi",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=100, env=os.environ.copy(),
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Q2_K" in proc.stderr and "it runs F32, F16, BF16, Q8_0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_served_name_is_the_file_stem(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    path = write_tiny_gguf(folder / "Tiny-1B.Q8_0.gguf", "llama", weight_type=Q.Q8_0).path
    assert served_model_name(path) == "Tiny-1B.Q8_0"
    assert served_model_name(folder) == "Tiny-1B.Q8_0"  # the folder's one GGUF file
    assert served_model_name(tmp_path / "hf-folder") == "hf-folder"


def test_structured_outputs_read_the_gguf_tokenizer(tmp_path: Path) -> None:
    from asyncengine.sampling_params import StructuredOutputsParams

    tiny = write_tiny_gguf(tmp_path / "s.gguf", "qwen2", weight_type=Q.Q8_0, seed=3)
    llm = LLM(tiny.path, device="cpu")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=["Hello world", "lol"]),
    )
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert out.outputs[0].text in ("Hello world", "lol")
    _assert_free(llm)


def test_rope_freqs_divide_the_rotary_frequencies(tmp_path: Path) -> None:
    """Llama 3.1-style rope scaling as llama.cpp's converter stores it: a rope_freqs tensor of
    divisors, applied as llama.cpp applies it (the reference: transformers with its inverse
    frequencies divided by the same values)."""
    head_dim = 16
    factors = np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32)
    tiny = write_tiny_gguf(
        tmp_path / "l31.gguf", "llama", weight_type=Q.Q8_0, seed=4,
        extra_tensors={"rope_freqs.weight": (factors, Q.F32)},
    )  # fmt: skip
    plain = write_tiny_gguf(tmp_path / "plain.gguf", "llama", weight_type=Q.Q8_0, seed=4)
    got = _greedy(tiny.path)
    reference = _reference_model(tiny.path, tiny, True, freq_factors=factors)
    _assert_greedy_matches(got, reference, PROMPTS)
    assert got != _greedy(plain.path)  # the factors change the tokens here


def test_a_rope_freqs_tensor_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    factors = np.ones(5, dtype=np.float32)
    path = write_tiny_gguf(
        tmp_path / "bad.gguf", "llama", extra_tensors={"rope_freqs.weight": (factors, Q.F32)}
    ).path
    with pytest.raises(GGUFError, match=r"rope_freqs.weight is F32 of shape \[5\]: expected 8"):
        LLM(path, device="cpu")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_speculative_decoding_runs_on_quantized_weights(tmp_path: Path, qtype: Q) -> None:
    """n-gram drafts verified by the quantized kernels (several rows a step): greedy tokens
    still follow the dequantized reference (up to near-ties: the verify step's products sum
    in another order than one-row decodes), drafts were accepted, and every KV block is
    back, the rolled-back ones included."""
    shapes = K_SHAPES if qtype is Q.Q4_K else None
    tiny = write_tiny_gguf(tmp_path / "spec.gguf", "llama", weight_type=qtype, seed=3,
                           shapes=shapes)  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(tiny.path, device="cpu", dtype="float32", speculative_config=spec)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.statistics()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    _assert_free(llm)
    got = [list(o.outputs[0].token_ids) for o in outs]
    _assert_greedy_matches(got, _reference_model(tiny.path, tiny, True), PROMPTS)


@pytest.mark.parametrize("weight_type", [Q.Q4_K, Q.Q5_0, Q.Q4_0], ids=lambda v: v.name)
def test_projections_load_interleaved_on_the_vnni_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_type: Q
) -> None:
    """On AVX512-VNNI the Q4_K (Q5_0, Q4_0) projections and the tied lm_head are repacked at
    load (quant_cpu.decode_layout; on AVX2 Q5_0 becomes Q5_0_BYTES), the embedding looks its
    rows up in the lm_head's copy,
    and the greedy tokens follow the dequantized reference as the file's layout's do (not
    always the same tokens: the tiles sum in fp32 in another order, and a difference in the
    last bit can round a later activation to another int8 value)."""
    from asyncengine.config import EngineConfig
    from asyncengine.kernels import quant_cpu
    from asyncengine.model.gguf_checkpoint import load_gguf_forward
    from asyncengine.model.quant_linear import QuantLinear

    tiny = write_tiny_gguf(
        tmp_path / "q.gguf",
        "llama",
        weight_type=weight_type,
        tied=True,
        shapes=K_SHAPES,
        seed=7,
        vocab_multiple=8,  # whole groups of 8 rows: the lm_head is interleaved too
    )
    config = EngineConfig.from_kwargs(tiny.path, device="cpu", dtype="bfloat16")
    forward = load_gguf_forward(config.model_config)
    *projections, lm_head = forward.linear_layers()
    vnni = quant_cpu.current_path() == "avx512_vnni"
    assert all(isinstance(m, QuantLinear) for m in projections)
    qtype = weight_type.name.lower()
    want = qtype + "_r8" if vnni else qtype
    if quant_cpu.current_path() == "avx2" and qtype == quant_cpu.Q5_0:
        want = quant_cpu.Q5_0_BYTES
    assert {m.qtype for m in projections} == {want}  # type: ignore[union-attr]
    assert isinstance(lm_head, QuantLinear) and lm_head.qtype == want
    assert forward._embed_rows is not None and forward._embed_rows.qweight is lm_head.qweight
    reference = _reference_model(tiny.path, tiny, True)
    _assert_greedy_matches(_greedy(tiny.path), reference, PROMPTS)
    monkeypatch.setattr(quant_cpu, "REPACK_R8", False)
    monkeypatch.setattr(quant_cpu, "Q5_0_AS_BYTES", False)
    _assert_greedy_matches(_greedy(tiny.path), reference, PROMPTS)


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("qwen2", Q.Q8_0), ("llama", Q.Q4_K)],
    ids=lambda v: getattr(v, "name", v),
)
def test_projections_of_one_quantized_type_are_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, qtype: Q
) -> None:
    """q/k/v (with qwen2's biases) and gate/up of one type load as one layer each, with the
    separate layers' greedy tokens; where v is another type (Q4_K_M's mix) q/k/v stay
    separate and gate/up are still joined."""
    from asyncengine.config import EngineConfig
    from asyncengine.model import gguf_checkpoint
    from asyncengine.model.quant_linear import QuantLinear

    shapes = K_SHAPES if qtype is Q.Q4_K else Shapes()
    tiny = write_tiny_gguf(tmp_path / "j.gguf", arch, weight_type=qtype, shapes=shapes, seed=9)
    config = EngineConfig.from_kwargs(tiny.path, device="cpu", dtype="bfloat16")
    layer = gguf_checkpoint.load_gguf_forward(config.model_config)._layers[0]
    s = tiny.shapes
    assert layer.q_proj is None and layer.gate_proj is None and layer.up_proj is None
    assert isinstance(layer.qkv, QuantLinear) and isinstance(layer.gate_up, QuantLinear)
    assert layer.qkv.out_features == (s.heads + 2 * s.kv_heads) * s.head_dim
    assert (layer.qkv.bias is not None) == (arch == "qwen2")
    assert layer.gate_up.out_features == 2 * s.intermediate
    joined = _greedy(tiny.path)
    monkeypatch.setattr(gguf_checkpoint, "JOIN_QUANTIZED", False)
    assert _greedy(tiny.path) == joined
    monkeypatch.undo()

    mix = write_tiny_gguf(
        tmp_path / "mix.gguf", arch, weight_type=qtype, shapes=shapes, seed=9,
        type_overrides={"v_proj": Q.Q6_K if qtype is Q.Q4_K else Q.Q4_0},
    )  # fmt: skip
    config = EngineConfig.from_kwargs(mix.path, device="cpu", dtype="bfloat16")
    layer = gguf_checkpoint.load_gguf_forward(config.model_config)._layers[0]
    assert layer.qkv is None and isinstance(layer.v_proj, QuantLinear)
    assert isinstance(layer.gate_up, QuantLinear)


@pytest.mark.timeout(300)
def test_a_quantized_lm_head_picks_the_samplers_tokens_from_its_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows and rows sampled by temperature alone take their tokens from the
    quantized lm_head's logits inside the forward (cpu_forward.pick_tokens): the tokens the
    sampler picks from the same logits (a seeded request's too); rows with a penalty still
    go to the sampler."""
    from asyncengine.model import cpu_forward

    tiny = write_tiny_gguf(tmp_path / "t.gguf", "llama", weight_type=Q.Q8_0, tied=True, seed=9)
    calls: list[int] = []
    real = cpu_forward.pick_tokens

    def spy(logits: torch.Tensor, choice: Any) -> torch.Tensor | None:
        calls.append(logits.shape[0])
        return real(logits, choice)

    common: dict[str, Any] = dict(max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, **common)
    sampled = [SamplingParams(temperature=0.9, seed=i, **common) for i in range(len(PROMPTS))]
    mixed = [greedy, sampled[1], greedy, sampled[3]]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, **common)

    def tokens(params: Any) -> list[list[int]]:
        llm = LLM(tiny.path, device="cpu", dtype="bfloat16")
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            _assert_free(llm)
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()

    monkeypatch.setattr(cpu_forward, "pick_tokens", spy)
    picked = [tokens(p) for p in (greedy, sampled, mixed)]
    assert calls and max(calls) <= len(PROMPTS)
    calls.clear()
    tokens(penalised)
    assert not calls
    monkeypatch.setattr(cpu_forward, "pick_tokens", lambda logits, choice: None)
    assert [tokens(p) for p in (greedy, sampled, mixed)] == picked


def test_pick_tokens_leaves_a_row_with_a_nan_logit_to_the_sampler() -> None:
    from asyncengine.model.cpu_forward import pick_tokens
    from asyncengine.model.interface import TokenChoice

    logits = torch.randn(3, 70).to(torch.bfloat16)
    want = logits[:, :64].float().argmax(dim=1)
    got = pick_tokens(logits, TokenChoice(64))
    assert got is not None and torch.equal(got, want)
    logits[1, 63] = float("nan")
    assert pick_tokens(logits, TokenChoice(64)) is None
    logits[1, 63] = 0.0
    logits[2, 66] = float("nan")  # past the vocabulary: not a candidate
    noise = torch.zeros(3, 70)
    temps = torch.tensor([0.0, 0.5, 2.0])
    got = pick_tokens(logits, TokenChoice(64, temps, noise))
    assert got is not None and torch.equal(got, logits[:, :64].float().argmax(dim=1))
