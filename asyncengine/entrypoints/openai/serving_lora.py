"""LoRA adapters over HTTP: the adapters a server starts with (`serve --lora-modules`), and,
with `--enable-lora-runtime-updates`, loading and unloading them while it runs (vLLM's
endpoints and bodies):

POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}   200, 400 for a bad folder
POST /v1/unload_lora_adapter  {"lora_name": ...}                     200, 404 for an unknown name

Requests name an adapter in their `model` field (ServerState.lora_for); /v1/models lists the
adapters with the served model as their parent. Behind the API key like every other path.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from asyncengine.entrypoints.openai.body import decode_request
from asyncengine.entrypoints.openai.errors import OpenAIError
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.lora.request import LoRARequest


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`name=path` pairs (`serve --lora-modules`) as a dict; ValueError naming a bad one."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: give name=path (a PEFT folder)")
        if name in modules:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules


async def add_lora_modules(state: ServerState, modules: Mapping[str, str]) -> None:
    """Load the adapters a server starts with (ValueError for a bad one: no server)."""
    for name, path in modules.items():
        if name == state.model_name:
            raise ValueError(f"LoRA adapter {name!r}: the served model has that name")
        await state.engine.add_lora(LoRARequest(name, path))


class LoRAServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def load(self, request: Request) -> Response:
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, LoadLoRAAdapterRequest)
        state.check_ready()
        if req.lora_name == state.model_name:
            raise OpenAIError(400, "lora_name is the served model's name", "lora_name")
        try:
            added = await state.engine.add_lora(LoRARequest(req.lora_name, req.lora_path))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "lora_path") from None
        what = "added" if added else "already loaded"
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' {what}.")

    async def unload(self, request: Request) -> Response:
        state = self.state
        req = await decode_request(request, state.max_request_body_bytes, UnloadLoRAAdapterRequest)
        state.check_ready()
        if req.lora_name not in state.engine.lora_names:
            await state.refresh_loras()  # another API server may have loaded it
        if req.lora_name not in state.engine.lora_names:
            raise OpenAIError(
                404, f"The LoRA adapter `{req.lora_name}` is not loaded.", "lora_name"
            )
        try:
            await state.engine.remove_lora(req.lora_name)
        except ValueError as exc:
            raise OpenAIError(404, str(exc), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed.")
