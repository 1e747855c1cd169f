"""The llama.cpp side of the peers harness (benchmarks/llamacpp.py): its batched-bench table,
GGUF conversion of a tiny model by llama.cpp's own converter, and llama.cpp's greedy tokens on
that model against asyncengine's.

The conversion needs llama.cpp's source (the pinned `llama-cpp-python` sdist, downloaded once
into .bench/); the greedy comparison needs llama-server built (`nox -s bench_peers` builds it,
or `python -c "from benchmarks.llamacpp import ensure_built; ensure_built()"`, ~9 minutes),
and is skipped, saying so, where it is not.
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import llamacpp
from benchmarks.servers import free_port, running_server

# Captured from llama-batched-bench (llama-cpp-python 0.3.36's llama.cpp) on SmolLM2 bf16.
SAMPLE = """
main: n_kv_max = 12000, n_batch = 2048, n_ubatch = 512, flash_attn = auto, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    80 |     64 |    1 |    144 |    0.225 |   355.59 |    0.911 |    70.24 |    1.136 |   126.74 |
|    80 |     64 |   16 |   2304 |    3.244 |   394.56 |    4.486 |   228.27 |    7.730 |   298.05 |
|    80 |     64 |   64 |   9216 |   13.074 |   391.60 |   15.864 |   258.20 |   28.938 |   318.47 |

llama_perf_context_print:        load time =     105.71 ms
"""


@pytest.mark.timeout(10)
def test_the_batched_bench_table_parses_to_numbers() -> None:
    rows = llamacpp.parse_batched_bench(SAMPLE)
    assert [r["B"] for r in rows] == [1.0, 16.0, 64.0]
    assert rows[2]["T s"] == 28.938 and rows[0]["S_TG t/s"] == 70.24
    # output tokens over wall time, as batched_bench reports them
    assert 64 * 64 / rows[2]["T s"] == pytest.approx(141.5, abs=0.1)
    assert llamacpp.parse_batched_bench("no table here\n| a | b |\n") == []


@pytest.fixture(scope="module")
def tiny_llama_with_smollm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (fp32) with SmolLM2's tokenizer: the converter does not take the
    test models' word-level tokenizer."""
    from asyncengine.entrypoints.default_model import default_model_dir
    from asyncengine.testing.models import build_tiny_model

    smol = default_model_dir()
    target = tmp_path_factory.mktemp("gguf") / "tiny"
    build_tiny_model(
        target, "llama", seed=3, dtype="float32", vocab_size=49152, hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
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


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_with_smollm_tokenizer: Path) -> Path:
    source = llamacpp.fetch_source()
    folder = tiny_llama_with_smollm_tokenizer
    return llamacpp.to_gguf(source, folder, folder.parent / "gguf", "f32")


@pytest.mark.timeout(600)
def test_conversion_writes_the_model_as_gguf(
    tiny_gguf: Path, tiny_llama_with_smollm_tokenizer: Path
) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(tiny_gguf)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    tensors = {t.name: t for t in reader.tensors}
    # 2 layers x 9 tensors, the embedding, the final norm, and the lm_head unless it is tied
    config = json.loads((tiny_llama_with_smollm_tokenizer / "config.json").read_text())
    assert len(tensors) == 2 * 9 + 2 + (0 if config.get("tie_word_embeddings") else 1)
    assert sorted(int(d) for d in tensors["token_embd.weight"].shape) == [64, 49152]
    assert sorted(int(d) for d in tensors["blk.1.ffn_up.weight"].shape) == [64, 160]
    # a second call finds the file up to date and leaves it alone
    mtime = tiny_gguf.stat().st_mtime_ns
    again = llamacpp.to_gguf(
        llamacpp.fetch_source(), tiny_llama_with_smollm_tokenizer, tiny_gguf.parent, "f32"
    )
    assert again == tiny_gguf and tiny_gguf.stat().st_mtime_ns == mtime


def _llama_cpp_greedy(base_url: str, prompt: list[int], n: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False}  # fmt: skip
    request = urllib.request.Request(
        base_url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return list(json.loads(response.read())["tokens"])


@pytest.mark.timeout(900)
def test_llama_cpp_greedy_tokens_equal_ours_in_fp32(
    tiny_gguf: Path, tiny_llama_with_smollm_tokenizer: Path
) -> None:
    source = llamacpp.fetch_source()
    if not source.built:
        pytest.skip(f"llama.cpp is not built in {source.bin} (see this module's docstring)")
    from asyncengine import LLM, SamplingParams

    prompts = [[1, 2, 3], [504, 3491, 30, 2587, 314, 253], list(range(100, 180, 3))]
    llm = LLM(str(tiny_llama_with_smollm_tokenizer), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    port = free_port()
    command = llamacpp.server_command(source, tiny_gguf, port, parallel=1, threads=2)
    with running_server(command, f"http://127.0.0.1:{port}", ready_timeout=120) as server:
        theirs = [_llama_cpp_greedy(server.base_url, p, 16) for p in prompts]
    assert theirs == ours


@pytest.mark.timeout(10)
def test_a_bad_outtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of bf16, f32, q8_0"):
        llamacpp.to_gguf(llamacpp.LlamaCpp(tmp_path), tmp_path, tmp_path, "q4_k")
