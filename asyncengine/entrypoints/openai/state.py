"""What every endpoint of one server shares: the engine, the served name, limits and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.entrypoints.openai.errors import OpenAIError
from asyncengine.entrypoints.openai.metrics import ServerMetrics
from asyncengine.lora.request import LoRARequest

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20


@dataclass(slots=True, eq=False)
class ServerState:
    engine: AsyncLLM
    model_name: str
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    metrics: ServerMetrics = field(init=False)
    # Engine request ids of every stream in flight, so that shutdown can abort them.
    in_flight: set[str] = field(default_factory=set)
    draining: bool = False  # shutting down: new requests get 503
    created: float = field(default_factory=time.time)
    # With several API server processes: where they share their metrics, and this one's index.
    metrics_dir: str | None = None
    api_server_index: int = 0

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(
            self.model_name, shared_dir=self.metrics_dir, process_index=self.api_server_index
        )

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served model (or left out)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist; this server serves "
                f"`{self.model_name}`.", "model"
            )  # fmt: skip

    async def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names; None for the served model (or none
        given); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model not in self.engine.lora_names:
            await self.refresh_loras()  # another API server may have loaded it
        if model in self.engine.lora_names:
            return LoRARequest(model)
        adapters = ", ".join(f"`{n}`" for n in self.engine.lora_names)
        raise OpenAIError(
            404, f"The model `{model}` does not exist; this server serves "
            f"`{self.model_name}`" + (f" and the LoRA adapters {adapters}." if adapters else "."),
            "model",
        )  # fmt: skip

    async def refresh_loras(self) -> None:
        """Learn the adapters the engine holds now (with `serve --api-server-count`, another
        API server may have loaded or unloaded one)."""
        engine = self.engine
        if engine.config.lora_config.enable_lora and engine.is_running:
            await engine.list_loras()

    def check_ready(self) -> None:
        """503 when the engine cannot take a request: dead, not started, or shutting down."""
        engine = self.engine
        if engine.dead_error is not None:
            raise OpenAIError(503, f"the engine is dead: {engine.dead_error}")
        if self.draining or engine.is_draining:
            raise OpenAIError(503, "the server is shutting down")
        if not engine.is_running:
            raise OpenAIError(503, "the engine is not running")

    def abort_all(self) -> int:
        """Abort every request in flight: their streams end with finish_reason "abort"."""
        request_ids = list(self.in_flight)
        for request_id in request_ids:
            self.engine.abort(request_id)
        return len(request_ids)
