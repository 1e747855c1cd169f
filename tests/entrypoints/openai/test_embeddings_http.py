"""`POST /v1/embeddings` through the official `openai` client: floats and base64, Matryoshka
`dimensions`, usage, every input shape, and 400s (never 500) for bad input, the server serving
on after each."""

from __future__ import annotations

import math
import re
from typing import Any

import httpx
import openai
import pytest
from openai_testing import MODEL_NAME, RunningServer

pytestmark = pytest.mark.timeout(120)


def _norm(v: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in v))


def test_embeddings_through_the_client(client: openai.OpenAI, server: RunningServer) -> None:
    one = client.embeddings.create(model=MODEL_NAME, input="hello world", encoding_format="float")
    assert one.object == "list" and one.model == MODEL_NAME and len(one.data) == 1
    vector = one.data[0].embedding
    assert one.data[0].index == 0 and len(vector) == 64
    assert math.isclose(_norm(vector), 1.0, rel_tol=1e-5)
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    # the client's default asks for base64 and decodes it: the same numbers
    again = client.embeddings.create(model=MODEL_NAME, input=["hello world", "the cat"])
    assert [d.index for d in again.data] == [0, 1]
    assert again.data[0].embedding == pytest.approx(vector, abs=1e-6)
    assert again.data[0].embedding != pytest.approx(again.data[1].embedding, abs=1e-3)
    cut = client.embeddings.create(
        model=MODEL_NAME, input="hello world", dimensions=8, encoding_format="float"
    )
    head = _norm(vector[:8])
    assert cut.data[0].embedding == pytest.approx([v / head for v in vector[:8]], rel=1e-4)
    ids = client.embeddings.create(
        model=MODEL_NAME, input=[[5, 6, 7], [8, 9]], encoding_format="float"
    )
    assert ids.usage.prompt_tokens == 5 and len(ids.data) == 2
    flat = client.embeddings.create(model=MODEL_NAME, input=[5, 6, 7], encoding_format="float")
    assert flat.data[0].embedding == pytest.approx(ids.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"input": []}, "input", "empty list"),
        ({"input": ["a", 5]}, "input", "not a mixture"),
        ({"input": [[5, 6], []]}, "input", r"input\[1\] is empty"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "one of float, base64"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions=0 is invalid"),
        ({"input": "a", "dimensions": 1000}, "dimensions", "hidden size, 64"),
        ({"input": "a", "pooling": "max"}, "pooling", "pooling='max' is invalid"),
        ({"input": [[10**9]]}, "input", "token ids must be in"),
        ({"input": 5}, None, "input"),
        ({"input": ["x"] * 2049}, "input", "2049 inputs in one request: at most 2048"),
    ],
)
def test_bad_input_is_a_400(
    server: RunningServer, body: dict[str, Any], param: str | None, match: str
) -> None:
    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=60) as http:
        reply = http.post("/embeddings", json={"model": MODEL_NAME, **body})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "BadRequestError" and re.search(match, error["message"])
        if param is not None:
            assert error["param"] == param
        ok = http.post("/embeddings", json={"model": MODEL_NAME, "input": "fine"})
        assert ok.status_code == 200


def test_an_unknown_model_is_a_404(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=60) as http:
        reply = http.post("/embeddings", json={"model": "other", "input": "x"})
        assert reply.status_code == 404
