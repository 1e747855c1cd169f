"""LLMEngine: the synchronous in-process engine behind `LLM` and the CLI.

add_request → InputProcessor → EngineCore.add_request; step → EngineCore.step →
OutputProcessor → RequestOutputs (stop-string hits are aborted in the core).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncengine.client.chat import ChatPrompt
from asyncengine.client.input_processor import InputProcessor, Prompt, request_limits
from asyncengine.client.output_processor import OutputProcessor
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.config import EngineConfig
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # The core pulls in torch; the rest of client/ must not, so import it here.
        from asyncengine.core.engine_core import EngineCore, import_model_code

        config.check_core_kind("inline")
        self.tokenizer = Tokenizer(config.model_config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        import_model_code(config, owns_process=False)
        self.engine_core = EngineCore(config)
        self.config = self.engine_core.config
        self.input_processor = InputProcessor(
            self.tokenizer,
            config.model_config.vocab_size,
            request_limits(self.config),
            config.model_config.sampling_defaults,
        )

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str], **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt | ChatPrompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        pooling: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. ValueError for a bad request.
        `pooling`: an embedding request (its final output carries `embedding`)."""
        if request_id is not None and request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = self.input_processor.process(
            prompt, params, request_id=request_id, priority=priority, pooling=pooling,
            lora_name=lora_name,
        )  # fmt: skip
        added: list[str] = []
        try:
            for core_request in request.core_requests:
                self.engine_core.add_request(core_request)
                added.append(core_request.request_id)
        except BaseException:
            self.engine_core.abort_requests(added)
            raise
        self.output_processor.add_request(request)
        return request.request_id

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests that made progress.

        EngineGenerateError if a request's output could not be processed (that request is
        aborted; the others stay queued)."""
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.core_ids_to_abort:
            self.engine_core.abort_requests(processed.core_ids_to_abort)
        if processed.failed:
            raise processed.failed[0][1]
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def rpc_arguments(
    method: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[list[Any], dict[str, Any]]:
    """`collective_rpc`'s arguments as a worker sees them (what msgpack gives back: tuples
    become lists); TypeError naming `method` for any that msgspec cannot encode."""
    if not isinstance(method, str):
        raise TypeError(f"collective_rpc: method must be a str, not {type(method).__name__}")
    try:
        wire = msgspec.msgpack.encode((list(args), dict(kwargs or {})))
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(
            f"collective_rpc({method!r}): an argument msgspec cannot encode: {exc}"
        ) from None
    wire_args, wire_kwargs = msgspec.msgpack.decode(wire)
    return wire_args, wire_kwargs
