"""Fixtures for the OpenAI-compatible server: one server per module (over `chat_model`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai_testing import API_KEY, ENGINE_KW, MAX_BODY, MODEL_NAME, RunningServer, run_in_thread

from asyncengine import AsyncLLM
from asyncengine.entrypoints.openai import build_app


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


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    """The official client of `server`, with its API key and no retries."""
    with openai.OpenAI(
        base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60
    ) as client:
        yield client
