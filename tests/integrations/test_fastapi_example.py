"""The FastAPI example (docs/examples/fastapi_app.py): the engine opened in the app's
lifespan, a custom SSE endpoint, and the OpenAI routes mounted beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from integration_helpers import ENGINE_KW, load_example
from starlette.testclient import TestClient

pytestmark = pytest.mark.timeout(120)

example = load_example("fastapi_app")


def test_fastapi_example(tiny_llama: Path) -> None:
    app = example.make_app(str(tiny_llama), **ENGINE_KW)
    with TestClient(app) as client:  # runs the lifespan: the engine starts, then stops
        body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
        with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = "".join(response.iter_text())
        assert raw.endswith("data: [DONE]\n\n")
        events = [json.loads(b[6:]) for b in raw[:-2].split("\n\n")[:-1]]
        text = "".join(e["text"] for e in events)

        # The mounted OpenAI routes share the engine: the same greedy text.
        completion = client.post(
            "/openai/v1/completions",
            json={"model": "local", "prompt": "hello world", "max_tokens": 8, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == text
        assert client.get("/openai/v1/models").json()["data"][0]["id"] == "local"
        assert client.get("/openai/health").status_code == 200

        bad = client.post("/generate", json={"prompt": "hi", "temperature": -1})
        assert bad.status_code == 400 and "temperature" in bad.text
