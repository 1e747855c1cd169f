"""Fixtures for the OpenAI-compatible server: a tiny chat model, one server per module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_testing import API_KEY, ENGINE_KW, MAX_BODY, MODEL_NAME, RunningServer, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template (the tiny tokenizer is saved without one)."""
    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    """A real uvicorn server on 127.0.0.1 (a free port), in a thread, with an in-process
    engine core; API key and a small body limit, so every error status can be reached."""
    engine = AsyncLLM.from_pretrained(chat_model, core="thread", **ENGINE_KW)
    app = build_app(
        engine, served_model_name=MODEL_NAME, api_key=API_KEY, max_request_body_bytes=MAX_BODY
    )
    with run_in_thread(app) as running:
        yield running
