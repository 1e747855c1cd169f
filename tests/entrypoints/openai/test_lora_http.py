"""LoRA adapters over HTTP (a real server on 127.0.0.1, the official client): the `model`
field picks an adapter, /v1/models lists adapters with their parent, adapters given at start
(`lora_modules`) and loaded and unloaded at run time (`enable_lora_runtime_updates`, behind
the API key), and 404 / 400 for unknown names and bad folders."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from openai_testing import API_KEY, ENGINE_KW, MODEL_NAME, RunningServer, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints import cli
from asyncengine.entrypoints.openai import build_app
from asyncengine.entrypoints.openai.serving_lora import parse_lora_modules
from asyncengine.testing.lora import build_peft_adapter

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def folders(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "attn": build_peft_adapter(chat_model, root / "attn", target_modules=["q_proj"], seed=1),
        "mlp": build_peft_adapter(chat_model, root / "mlp", target_modules=["up_proj"], seed=2),
    }


@pytest.fixture(scope="module")
def server(chat_model: Path, folders: dict[str, Path]) -> Iterator[RunningServer]:
    engine = AsyncLLM.from_pretrained(chat_model, core="thread", enable_lora=True, **ENGINE_KW)
    app = build_app(
        engine, served_model_name=MODEL_NAME, api_key=API_KEY,
        lora_modules={"attn": str(folders["attn"])}, enable_lora_runtime_updates=True,
    )  # fmt: skip
    with run_in_thread(app) as running:
        yield running


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    return out.choices[0].text


def test_the_model_field_picks_the_adapter_and_models_lists_it(
    server: RunningServer, client: openai.OpenAI
) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "attn"}
    assert cards["attn"].model_dump()["parent"] == MODEL_NAME
    assert cards[MODEL_NAME].model_dump()["parent"] is None
    assert client.models.retrieve("attn").id == "attn"
    assert _complete(client, "attn") != _complete(client, MODEL_NAME)
    assert _complete(client, "attn") == _complete(client, "attn")  # greedy: the same again
    chat = client.chat.completions.create(
        model="attn", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert chat.model == "attn"  # responses name the model asked for
    assert client.completions.create(model="attn", prompt=PROMPT, max_tokens=1).model == "attn"


def test_an_unknown_model_is_404_naming_the_adapters(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="LoRA adapters `attn`"):
        _complete(client, "nobody")


def test_adapters_load_and_unload_at_run_time_behind_the_api_key(
    server: RunningServer, client: openai.OpenAI, folders: dict[str, Path], tmp_path: Path
) -> None:
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as http:
        body = {"lora_name": "mlp", "lora_path": str(folders["mlp"])}
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 401
        loaded = http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert "mlp" in {m.id for m in client.models.list().data}
        assert _complete(client, "mlp") != _complete(client, MODEL_NAME)
        bad = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
        )
        assert bad.status_code == 400 and "not a PEFT folder" in bad.text
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
        assert unloaded.status_code == 200, unloaded.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp")


def test_lora_modules_are_name_equals_path() -> None:
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=/x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)


def test_serve_refuses_a_bad_lora_module_before_loading(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", str(chat_model), "--port", "0", "--lora-modules", "oops"]) == 2
    assert "give name=path" in capsys.readouterr().err


def test_two_api_servers_serve_the_adapters_and_learn_each_others_loads(
    chat_model: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(chat_model),
        "--port", "0", "--served-model-name", MODEL_NAME, "--no-access-log", "--device", "cpu",
        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
        "--api-server-count", "2", "--shutdown-timeout", "5",
        "--lora-modules", f"attn={folders['attn']}", "--enable-lora-runtime-updates",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 150
        while len(re.findall(r"Application startup complete", log.read_text())) < 2:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        m = re.search(r"serving on ([\d.]+):(\d+)", log.read_text())
        assert m is not None, log.read_text()
        url = f"http://{m.group(1)}:{m.group(2)}"
        body = {"lora_name": "mlp", "lora_path": str(folders["mlp"])}
        assert httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
        # Fresh connections, so that both API servers answer some: every one knows both.
        texts: dict[str, set[str]] = {"attn": set(), "mlp": set()}
        for _ in range(6):
            for name in texts:
                request = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
                r = httpx.post(url + "/v1/completions", json=request, timeout=60)
                assert r.status_code == 200, r.text
                texts[name].add(r.json()["choices"][0]["text"])
            models = httpx.get(url + "/v1/models", timeout=60).json()["data"]
            assert {m["id"] for m in models} == {MODEL_NAME, "attn", "mlp"}
        assert all(len(t) == 1 for t in texts.values()), texts  # greedy: one answer each
    finally:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # the manager drains both servers and the core
        try:
            assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
