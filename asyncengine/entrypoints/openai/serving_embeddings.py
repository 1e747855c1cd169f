"""`POST /v1/embeddings`: OpenAI's embeddings, from the same engine that generates.

request body → EmbeddingRequest → one token-id prompt per input (checked as completions'
prompts are) → `AsyncLLM.embed` → float lists or base64 of little-endian fp32, with usage.
"""

from __future__ import annotations

import base64
import struct

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.client.embedding import EMBED_PARAMS, MAX_INPUTS, check_embed_options
from asyncengine.entrypoints.openai.body import decode_request
from asyncengine.entrypoints.openai.errors import bad_request
from asyncengine.entrypoints.openai.generation import EnginePrompt, check_request, engine_prompts
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.entrypoints.sse import call_until_disconnect

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids (one
    # array type per msgspec union: checked by hand).
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # asyncengine's: how the hidden states are pooled ("last", for decoder embedding models;
    # "mean"; "cls")
    pooling: str = "last"


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class EmbeddingServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: Request) -> Response:
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, EmbeddingRequest)
        state.check_model(req.model)
        state.check_ready()
        if req.encoding_format not in ENCODING_FORMATS:
            raise bad_request(
                f"encoding_format={req.encoding_format!r} is invalid: one of float, base64",
                "encoding_format",
            )
        hidden = state.engine.config.model_config.hidden_size
        try:
            check_embed_options(req.pooling, True, req.dimensions, hidden)
        except ValueError as exc:
            raise bad_request(
                str(exc), "pooling" if "pooling" in str(exc) else "dimensions"
            ) from None
        prompts = self._prompts(req)

        async def embed() -> bytes:
            vectors = await state.engine.embed(
                [p.token_ids for p in prompts], pooling=req.pooling, dimensions=req.dimensions
            )
            data = [
                EmbeddingData(index=i, embedding=_encode(v, req.encoding_format))
                for i, v in enumerate(vectors)
            ]
            tokens = sum(len(p.token_ids) for p in prompts)
            usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
            return msgspec.json.encode(
                EmbeddingResponse(data=data, model=state.model_name, usage=usage)
            )

        body = await call_until_disconnect(request.receive, embed)
        # None: the client went away and its requests were aborted; nobody reads this.
        return Response(body or b"", media_type="application/json")

    def _prompts(self, req: EmbeddingRequest) -> list[EnginePrompt]:
        prompts = engine_prompts(req.input, self.state.engine.tokenizer, "input")
        if len(prompts) > MAX_INPUTS:
            raise bad_request(
                f"{len(prompts)} inputs in one request: at most {MAX_INPUTS}", "input"
            )
        for i, p in enumerate(prompts):
            if not p.token_ids:
                raise bad_request(f"input[{i}] is empty: give at least one token", "input")
        check_request(self.state, prompts, EMBED_PARAMS, 0, "input")
        return prompts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
