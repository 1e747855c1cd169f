"""LLM: the synchronous offline API — many prompts in, their outputs in input order."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from asyncengine.client.chat import ChatPrompt, Conversation, render_chat
from asyncengine.client.embedding import (
    EMBED_PARAMS,
    check_embed_options,
    embedding_inputs,
    finish_vector,
)
from asyncengine.client.input_processor import Prompt
from asyncengine.client.llm_engine import LLMEngine, rpc_arguments
from asyncengine.client.lora import adapter_folder, resolve_lora
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from asyncengine.ipc.messages import EngineStats
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline batched generation with the engine core in this process.

    >>> llm = LLM("path/to/model", dtype="bfloat16")
    >>> outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16))

    Keyword arguments are EngineConfig's (dtype, device, block_size, num_kv_blocks,
    kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, scheduling_policy, seed). The token budget of a step defaults to
    2,048 on every device here (serving engines use 1,024 or fewer on CPUs, for earlier first
    tokens).
    """

    def __init__(self, model: str | os.PathLike[str], **config: Any) -> None:
        if config.get("max_num_batched_tokens") is None:
            config["max_num_batched_tokens"] = OFFLINE_MAX_NUM_BATCHED_TOKENS
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **config))
        self._counter = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without any gets: the model's sampling defaults
        (its generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), SamplingParams' own for the rest. Start from it to change one field
        and keep the model's other defaults (`msgspec.structs.replace(p, max_tokens=64)`)."""
        return self.engine.input_processor.default_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in input order.

        `prompts` is one prompt or a list (a prompt is a string or a list of token ids);
        `params` is one SamplingParams for all, or one per prompt; `lora_request` one LoRA
        adapter for all, or one (or None: the base model) per prompt. A bad prompt,
        parameter or adapter raises ValueError before anything runs.
        """
        return self._generate(_as_prompt_list(prompts), params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`generate()` for conversations rendered with the model's chat template.

        `messages` is one conversation (`[{"role", "content"}, ...]`) or a list of them; the
        outputs come back in the same order. ValueError for a bad message or a model without
        a chat template, before anything runs.
        """
        # A list of conversations is a list of lists; anything else is one conversation
        # (render_chat names what is wrong with it).
        first = messages[0] if isinstance(messages, Sequence) and messages else None
        many = isinstance(first, Sequence) and not isinstance(first, (str, bytes))
        conversations = list(messages) if many else [messages]
        tokenizer = self.engine.tokenizer
        prompts = [
            render_chat(tokenizer, c, chat_template_kwargs=chat_template_kwargs)
            for c in conversations
        ]
        return self._generate(prompts, params, use_tqdm, lora_request)

    def embed(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """`AsyncLLM.embed()` offline: one fp32 vector per input, in input order."""
        prompts = embedding_inputs(inputs)
        check_embed_options(pooling, normalize, dimensions, self.config.model_config.hidden_size)
        for prompt in prompts:  # validate everything first: nothing half queued
            self.engine.input_processor.tokenize(prompt)
        ids: list[str] = []
        try:
            for prompt in prompts:
                request_id = f"llm-{next(self._counter)}"
                ids.append(
                    self.engine.add_request(request_id, prompt, EMBED_PARAMS, pooling=pooling)
                )
            outputs = self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        vectors = []
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"embedding request {out.request_id} finished without one")
            vectors.append(finish_vector(out.embedding, dimensions, normalize))
        return vectors

    def _generate(
        self,
        prompt_list: Sequence[Prompt | ChatPrompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            given = params if params is not None else self.get_default_sampling_params()
            param_list = [given] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts: "
                    "give one for all, or exactly one per prompt"
                )
        # Validate everything first, so a bad prompt cannot leave half a batch queued.
        for prompt in prompt_list:
            self.engine.input_processor.tokenize(prompt)
        lora_names = self._lora_names(lora_request, len(prompt_list))
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompt_list, param_list, lora_names, strict=True):
                # Offline callers want the final outputs only: don't build per-step ones.
                p = _final_only(p)
                request_id = f"llm-{next(self._counter)}"
                ids.append(self.engine.add_request(request_id, prompt, p, lora_name=lora))
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`AsyncLLM.add_lora`: load a LoRA adapter under its name (False: held already)."""
        name, folder = adapter_folder(lora_request)
        return self.engine.engine_core.add_lora(name, folder)

    def remove_lora(self, name: str) -> None:
        """`AsyncLLM.remove_lora`: unload adapter `name` (ValueError: not held)."""
        self.engine.engine_core.remove_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine holds, by name."""
        return [LoRARequest(n, p) for n, p in self.engine.engine_core.list_loras()]

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[str | None]:
        """Each prompt's adapter name, the adapters the engine lacks added first."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * count
        else:
            requests = list(lora_request)
            if len(requests) != count:
                raise ValueError(
                    f"got {len(requests)} LoRA requests for {count} prompts: give one for "
                    "all, or exactly one (or None) per prompt"
                )
        names: list[str | None] = []
        for request in requests:
            name, folder = resolve_lora(request, dict(self.engine.engine_core.loras))
            if name is not None and folder is not None:
                self.engine.engine_core.add_lora(name, folder)
            names.append(name)
        return names

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def statistics(self) -> EngineStats:
        """A frozen snapshot: running/waiting requests, KV blocks used/total, prefix-cache hits."""
        return self.engine.engine_core.statistics()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's contents (blocks in use stay allocated); returns True."""
        return self.engine.engine_core.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """`AsyncLLM.collective_rpc`, synchronously: a worker extension's `method` on every
        worker, one result each in rank order. `timeout` holds with worker processes
        (tensor_parallel_size > 1); the one in-process worker cannot be interrupted."""
        wire_args, wire_kwargs = rpc_arguments(method, args, kwargs)
        return self.engine.engine_core.collective_rpc(method, wire_args, wire_kwargs, timeout)

    def start_profile(self, profile_dir: str | os.PathLike[str] | None = None) -> None:
        """`AsyncLLM.start_profile`: torch.profiler in every worker until `stop_profile()`."""
        if profile_dir is None:
            raise ValueError(
                "start_profile() needs a profile_dir: the folder the traces are written to"
            )
        self.engine.engine_core.start_profile(os.path.abspath(os.fspath(profile_dir)))

    def stop_profile(self) -> list[str]:
        """Stop the profile and write one chrome trace per worker; their paths."""
        return self.engine.engine_core.stop_profile()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    import msgspec

    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
