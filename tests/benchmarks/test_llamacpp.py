"""The llama.cpp side of the peers harness (benchmarks/peers/llamacpp.py): its batched-bench table,
GGUF conversion of tiny models by llama.cpp's own converter, and llama.cpp's greedy tokens on
them against asyncengine's.

The conversion needs llama.cpp's source (the pinned `llama-cpp-python` sdist, downloaded once
into .bench/llamacpp/); the greedy comparison needs llama.cpp built there (about 9 minutes on 2
cores the first time, hence those tests' long timeouts). Those tests are marked `peers` and run
only when asked for: `ASYNCENGINE_TEST_PEERS=1 python -m pytest -m peers` (the README's second
test command).
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# benchmarks/ sits beside the package at the repository root, which is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import llamacpp
from benchmarks.peers.servers import free_port, log_tail, running_server

# llama-batched-bench's output (stdout, then stderr) from the pinned release, on SmolLM2-135M
# bf16 with batched_bench()'s defaults, on 2 busy cores (hence the low speeds).
SAMPLE = """
llama_batched_bench: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = -1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    80 |     64 |    1 |    144 |    2.601 |    30.76 |   45.239 |     1.41 |   47.839 |     3.01 |
|    80 |     64 |   16 |   2304 |   12.622 |   101.41 |   21.833 |    46.90 |   34.454 |    66.87 |
|    80 |     64 |   64 |   9216 |   21.834 |   234.50 |  167.426 |    24.46 |  189.259 |    48.70 |


0.00.295.115 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 16384
"""


@pytest.mark.timeout(10)
def test_the_batched_bench_table_parses_to_numbers() -> None:
    rows = llamacpp.parse_batched_bench(SAMPLE)
    assert [(r["PP"], r["TG"], r["B"]) for r in rows] == [(80, 64, 1), (80, 64, 16), (80, 64, 64)]
    assert rows[2]["T s"] == 189.259 and rows[0]["S_TG t/s"] == 1.41
    assert set(rows[0]) == {
        "PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"
    }  # fmt: skip
    assert llamacpp.parse_batched_bench("no table here\n| a | b |\n| 1 | 2 |\n") == []


@pytest.mark.timeout(10)
def test_one_batch_size_alone_gets_the_largest_batchs_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run of one batch size (the peers harness pairs the engines size by size) sizes the KV
    context as a run of all of them would: the figure must not depend on the pairing."""
    import subprocess

    commands: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=SAMPLE, stderr="")

    monkeypatch.setattr(llamacpp.subprocess, "run", fake_run)
    llama = llamacpp.LlamaCpp(source=tmp_path)
    gguf = tmp_path / "m.gguf"
    one = llamacpp.batched_bench(llama, gguf, batches=[1], context_batch=64)
    assert one == {1: pytest.approx(64 / 47.839)}
    assert commands[-1][commands[-1].index("-c") + 1] == str(64 * 144)
    llamacpp.batched_bench(llama, gguf, batches=[1, 16])
    assert commands[-1][commands[-1].index("-c") + 1] == str(16 * 144)  # default: the largest


@pytest.fixture(scope="session")
def llama_source() -> llamacpp.LlamaCpp:
    """llama.cpp's source (the converter), downloaded on first use."""
    return llamacpp.fetch_source()


@pytest.fixture(scope="session")
def llama_built() -> llamacpp.LlamaCpp:
    """llama.cpp with its tools, built on first use (minutes)."""
    return llamacpp.ensure_built()


# Tiny random models, big enough for a real comparison: SmolLM2's 49152-token vocabulary (the
# converter does not take the test models' word-level tokenizer, so SmolLM2's is copied in).
# The Qwen2 one is like benchmark model d: a vocabulary padded past the tokenizer's, tied
# embeddings, q/k/v biases (made non-zero below: the builder leaves them at zero).
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "qwen2": dict(
        vocab_size=49152 + 128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model (fp32) with SmolLM2's tokenizer."""
    from asyncengine.default_model import default_model_dir
    from asyncengine.testing.models import build_tiny_model

    arch = request.param
    target = tmp_path_factory.mktemp(f"gguf-{arch}") / "model"
    build_tiny_model(target, arch, seed=3, dtype="float32", **TINY[arch])
    _randomize_biases(target)
    smol = default_model_dir()
    for stale in target.glob("*token*"):
        stale.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, target / name)
    config = json.loads((target / "config.json").read_text())
    smol_config = json.loads((smol / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = smol_config.get(key)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _randomize_biases(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(4)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = 0.5 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tiny_gguf(llama_source: llamacpp.LlamaCpp, tiny_model: Path) -> Path:
    return llamacpp.to_gguf(llama_source, tiny_model, tiny_model.parent / "gguf", "f32")


@pytest.mark.peers
@pytest.mark.timeout(600)
def test_conversion_writes_the_model_as_gguf(tiny_gguf: Path, tiny_model: Path) -> None:
    from gguf import GGUFReader

    config = json.loads((tiny_model / "config.json").read_text())
    arch = config["model_type"]
    reader = GGUFReader(tiny_gguf)
    fields = reader.fields
    assert fields["general.architecture"].contents() == arch
    assert fields[f"{arch}.block_count"].contents() == 2
    assert fields[f"{arch}.embedding_length"].contents() == 64
    assert fields[f"{arch}.attention.head_count_kv"].contents() == 2
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(
        config["rms_norm_eps"]
    )
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert fields[f"{arch}.rope.freq_base"].contents() == rope_theta
    # SmolLM2's tokenizer, recognized, and padded with placeholders to the model's vocabulary
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == config["vocab_size"]
    assert tokens[1] == "<|im_start|>" and tokens[49151] != "[PAD49151]"
    padding = range(49152, config["vocab_size"])  # none for the Llama
    assert [tokens[i] for i in padding] == [f"[PAD{i}]" for i in padding]

    shapes = {t.name: sorted(int(d) for d in t.shape) for t in reader.tensors}
    per_layer = 12 if arch == "qwen2" else 9  # Qwen2 has q/k/v biases
    tied = config.get("tie_word_embeddings", False)
    assert len(shapes) == 2 * per_layer + 2 + (0 if tied else 1)
    assert shapes["token_embd.weight"] == [64, config["vocab_size"]]
    assert shapes["blk.1.ffn_up.weight"] == [64, 160]
    assert shapes["blk.0.attn_k.weight"] == [32, 64]  # 2 kv heads of 16
    assert ("output.weight" in shapes) == (not tied)


@pytest.mark.peers
@pytest.mark.timeout(600)
def test_conversion_is_cached_until_the_model_changes(
    llama_source: llamacpp.LlamaCpp, tiny_gguf: Path, tiny_model: Path
) -> None:
    made = tiny_gguf.stat().st_mtime_ns
    again = llamacpp.to_gguf(llama_source, tiny_model, tiny_gguf.parent, "f32")
    assert again == tiny_gguf and tiny_gguf.stat().st_mtime_ns == made
    config = tiny_model / "config.json"
    config.write_text(config.read_text())  # newer than the GGUF now
    again = llamacpp.to_gguf(llama_source, tiny_model, tiny_gguf.parent, "f32")
    assert again == tiny_gguf and tiny_gguf.stat().st_mtime_ns > made
    assert [p.name for p in tiny_gguf.parent.iterdir()] == [tiny_gguf.name]  # no leftovers


def _completion(base_url: str, prompt: list[int], n: int) -> list[int]:
    """llama-server's greedy continuation of the token ids `prompt`: argmax alone (no
    penalties or other samplers), EOS ignored, no KV reuse from the previous request."""
    body = {
        "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
        "ignore_eos": True, "return_tokens": True, "cache_prompt": False,
    }  # fmt: skip
    # http.client, not urllib: urllib would send a loopback request through an http_proxy.
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    assert response.status == 200, payload[-2000:]
    return list(json.loads(payload)["tokens"])


@pytest.mark.peers
@pytest.mark.timeout(1200)  # the session's first use of llama_built may build llama.cpp
def test_llama_cpp_greedy_tokens_equal_ours_in_fp32(
    llama_built: llamacpp.LlamaCpp, tiny_gguf: Path, tiny_model: Path, tmp_path: Path
) -> None:
    from asyncengine import LLM, SamplingParams

    generator = torch.Generator().manual_seed(6)
    lengths = [1, 3, 17, 64, 150]
    prompts = [torch.randint(4, 49152, (n,), generator=generator).tolist() for n in lengths]
    new_tokens = 16
    llm = LLM(tiny_model, device="cpu", dtype="float32", max_model_len=512)
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()

    port = free_port()
    # A KV cache in f32 too (its default is f16), so that both sides compute in fp32.
    command = llamacpp.server_command(
        llama_built, tiny_gguf, port, parallel=1, threads=2, ctx_per_slot=512,
        extra_args=["-ctk", "f32", "-ctv", "f32"],
    )  # fmt: skip
    log = tmp_path / "llama-server.log"
    try:
        with running_server(command, f"http://127.0.0.1:{port}", log_path=log) as server:
            theirs = [_completion(server.base_url, p, new_tokens) for p in prompts]
        assert theirs == ours
    except BaseException:
        print(f"--- the end of {log} ---\n{log_tail(log)}")  # shown with the failure
        raise


@pytest.mark.timeout(10)
def test_a_bad_outtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of bf16, f32, q8_0"):
        llamacpp.to_gguf(llamacpp.LlamaCpp(tmp_path), tmp_path, tmp_path, "q4_k")


@pytest.mark.timeout(10)
def test_the_server_command_keeps_llama_server_off_the_network(tmp_path: Path) -> None:
    command = llamacpp.server_command(
        llamacpp.LlamaCpp(tmp_path), tmp_path / "m.gguf", 8123, parallel=64, ctx_per_slot=256
    )
    assert command[0] == str(tmp_path / "build" / "bin" / "llama-server")
    joined = " ".join(command)
    assert "--host 127.0.0.1 --port 8123" in joined and "-np 64" in joined
    assert "-c 16384" in joined
    assert "--no-ui" in command and "--offline" in command
