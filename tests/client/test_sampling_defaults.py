"""Requests that leave sampling unset: the model's generation_config.json defaults apply (as in
vLLM), generate() stops after 16 tokens and chat() runs until the model stops or its context
ends (OpenAI's defaults for the two endpoints)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from async_helpers import ENGINE_KW

from asyncengine import LLM, AsyncLLM, EngineConfig, SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 48
HELLO = [{"role": "user", "content": "hello"}]
MODEL_DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def model_with_defaults(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(chat_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(MODEL_DEFAULTS, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def llm(model_with_defaults: Path) -> Iterator[LLM]:
    kw = {**ENGINE_KW, "max_model_len": MAX_MODEL_LEN}
    llm = LLM(model_with_defaults, **kw)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
async def engine(model_with_defaults: Path) -> AsyncIterator[AsyncLLM]:
    kw = {**ENGINE_KW, "max_model_len": MAX_MODEL_LEN}
    async with AsyncLLM.from_pretrained(model_with_defaults, core="thread", **kw) as engine:
        yield engine


def test_the_config_reads_the_sampling_defaults(model_with_defaults: Path) -> None:
    config = EngineConfig.from_kwargs(model_with_defaults, device="cpu")
    assert dict(config.model_config.sampling_defaults) == MODEL_DEFAULTS
    ignored = EngineConfig.from_kwargs(model_with_defaults, device="cpu", generation_config="vllm")
    assert ignored.model_config.sampling_defaults == ()
    assert ignored.model_config.eos_token_ids == config.model_config.eos_token_ids


def test_a_bad_default_in_the_file_is_an_error_naming_it(chat_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(chat_model, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config\.json.*temperature"):
        EngineConfig.from_kwargs(path, device="cpu")
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        EngineConfig.from_kwargs(chat_model, device="cpu", generation_config="nowhere")


def test_offline_requests_without_params_get_the_models_defaults(llm: LLM) -> None:
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.9, 20)
    assert defaults.repetition_penalty == 1.05 and defaults.max_tokens is msgspec.UNSET
    greedy = msgspec.structs.replace(defaults, max_tokens=16)
    [plain] = llm.generate("hello world", use_tqdm=False)
    [given] = llm.generate("hello world", greedy, use_tqdm=False)
    # temperature 0 came from the file: the same tokens as the explicit request.
    assert plain.outputs[0].token_ids == given.outputs[0].token_ids
    assert len(plain.outputs[0].token_ids) <= 16


def test_offline_chat_without_max_tokens_runs_to_the_end_of_the_context(llm: LLM) -> None:
    for params in (None, SamplingParams(temperature=0, ignore_eos=True)):
        [out] = llm.chat(HELLO, params, use_tqdm=False)
        completion = out.outputs[0]
        if params is not None or completion.finish_reason == "length":
            assert completion.finish_reason == "length"
            assert len(out.prompt_token_ids) + len(completion.token_ids) == MAX_MODEL_LEN
    # generate() keeps the completions default of 16 tokens.
    [out] = llm.generate("hello", SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16


async def test_async_chat_without_max_tokens_runs_to_the_end_of_the_context(
    engine: AsyncLLM,
) -> None:
    assert engine.get_default_sampling_params().top_k == 20
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    final = [out async for out in engine.chat(HELLO, greedy)][-1]
    assert final.outputs[0].finish_reason == "length"
    assert len(final.prompt_token_ids) + len(final.outputs[0].token_ids) == MAX_MODEL_LEN
    final = [out async for out in engine.generate("hello", greedy)][-1]
    assert len(final.outputs[0].token_ids) == 16


def test_a_chat_without_max_tokens_fits_a_cache_smaller_than_the_context(
    model_with_defaults: Path,
) -> None:
    # 2 blocks of 16 tokens: fewer than max_model_len; the chat is served, not refused.
    kw = {**ENGINE_KW, "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 2, "block_size": 16}
    llm = LLM(model_with_defaults, **kw)
    try:
        [out] = llm.chat(HELLO, SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    finally:
        llm.shutdown()
