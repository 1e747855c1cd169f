"""The server fills what a request leaves unset from the model's generation_config.json (as
vLLM does): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the
chat's budget."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai_testing import ENGINE_KW, RunningServer, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def greedy_by_default(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("greedy-default") / "model"
    shutil.copytree(chat_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def server(greedy_by_default: Path) -> Iterator[RunningServer]:
    engine = AsyncLLM.from_pretrained(greedy_by_default, core="thread", **ENGINE_KW)
    with run_in_thread(build_app(engine, served_model_name="m")) as running:
        yield running


def _chat(server: RunningServer, **fields: object) -> dict[str, object]:
    body = {"model": "m", "messages": MESSAGES, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, object] = response.json()
    return result


def _tokens(result: dict[str, object]) -> int:
    usage = result["usage"]
    assert isinstance(usage, dict)
    return int(usage["completion_tokens"])


def test_unset_fields_take_the_models_defaults(server: RunningServer) -> None:
    # temperature 0 from the file: different seeds give the same greedy text.
    first, second = (_chat(server, seed=s) for s in (1, 2))
    assert first["choices"] == second["choices"]
    assert _tokens(first) == 5  # max_new_tokens: the chat's budget when none is given


def test_fields_the_request_sets_win(server: RunningServer) -> None:
    texts = {
        json.dumps(_chat(server, seed=s, temperature=1.0, max_tokens=12)["choices"])
        for s in range(4)
    }
    assert len(texts) > 1  # sampled, as asked
    assert _tokens(_chat(server, max_tokens=9)) == 9
