"""Running a request's prompts through the engine, shared by both generation endpoints.

Each prompt becomes one engine request (`n` sequences), tokenised and checked here before
anything is sent (`check_request`: every check the engine's InputProcessor makes, with the
field named), so a bad request is a 400 before any response starts, even when streaming.
The prompts of a batch run concurrently in one task group; the first error cancels the rest.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

import anyio

from asyncengine.client.input_processor import InputProcessor, request_limits
from asyncengine.client.tokenizer import Tokenizer
from asyncengine.entrypoints.openai.errors import bad_request, from_value_error
from asyncengine.entrypoints.openai.state import ServerState
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.request_limits import check_token_ids
from asyncengine.sampling_params import SamplingParams

# Called with (prompt index, DELTA output) for every output of every prompt.
OnOutput = Callable[[int, RequestOutput], Awaitable[None]]


@dataclass(slots=True)
class EnginePrompt:
    token_ids: list[int]
    text: str | None = None  # the prompt as text, when given as text (for `echo`)


def engine_prompts(given: object, tokenizer: Tokenizer, param: str) -> list[EnginePrompt]:
    """A body's prompts (`prompt` of completions, `input` of embeddings: a string, a list of
    strings, a list of token ids, or a list of lists of token ids), tokenised; 400 naming
    `param` for an empty list or a mixture."""
    if isinstance(given, str):
        return [EnginePrompt(tokenizer.encode(given), given)]
    if not isinstance(given, list) or not given:
        raise bad_request(f"{param} is an empty list", param)
    if all(isinstance(p, str) for p in given):
        return [EnginePrompt(tokenizer.encode(p), p) for p in cast("list[str]", given)]
    if all(isinstance(p, int) for p in given):
        return [EnginePrompt(cast("list[int]", given))]
    if all(isinstance(p, list) for p in given):
        return [EnginePrompt(p) for p in cast("list[list[int]]", given)]
    raise bad_request(
        f"{param} must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids (not a mixture)",
        param,
    )


def check_request(
    state: ServerState,
    prompts: Sequence[EnginePrompt],
    params: SamplingParams,
    priority: int,
    param: str,
    max_tokens_param: str = "max_tokens",
) -> None:
    """400 naming the field for a request the engine would refuse; `param` names the prompts,
    `max_tokens_param` the output budget (chat's may be `max_completion_tokens`).

    Called before a response starts: the engine checks a request only when its stream is
    first read, which for a streamed response is after the status line went out.
    """
    for prompt in prompts:
        check_prompt(state, prompt, params, param, max_tokens_param)
    # Then the engine's own checks (the priority's range among them: msgspec decodes JSON
    # integers of any size), on an InputProcessor of our own that sends nothing: whatever
    # the engine would refuse is refused here, even a check added to it later.
    engine = state.engine
    processor = InputProcessor(
        engine.tokenizer, engine.config.model_config.vocab_size, request_limits(engine.config)
    )
    for prompt in prompts:
        try:
            processor.process(prompt.token_ids, params, priority=priority)
        except ValueError as exc:
            error = from_value_error(exc)
            raise (error if error.param else bad_request(str(exc), param)) from None


def check_prompt(
    state: ServerState,
    prompt: EnginePrompt,
    params: SamplingParams,
    param: str,
    max_tokens_param: str = "max_tokens",
) -> None:
    """400 (naming `param`, or `max_tokens_param`) for a prompt the engine would refuse."""
    model_config = state.engine.config.model_config
    num_tokens, max_len = len(prompt.token_ids), model_config.max_model_len
    try:
        check_token_ids(prompt.token_ids, model_config.vocab_size)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
    if num_tokens >= max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens, but the prompt has "
            f"{num_tokens} tokens, leaving no room for the completion.",
            param,
        )
    if isinstance(params.max_tokens, int) and num_tokens + params.max_tokens > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_tokens + params.max_tokens} tokens ({num_tokens} in the prompt, "
            f"{params.max_tokens} for the completion).",
            max_tokens_param,
        )
    try:
        request_limits(state.engine.config).check("this request", num_tokens, params)
    except ValueError as exc:
        error = from_value_error(exc)  # names `n` for too many sequences
        raise (error if error.param else bad_request(str(exc), max_tokens_param)) from None


async def run_prompts(
    state: ServerState,
    prompts: Sequence[EnginePrompt],
    params: SamplingParams,
    *,
    request_id: str,
    priority: int,
    arrival: float,
    on_output: OnOutput,
    lora_request: LoRARequest | None = None,
) -> None:
    """Generate for every prompt (with the LoRA adapter `lora_request` names, if any);
    `on_output` receives each DELTA output as it arrives.

    Cancellation (a client that went away) closes every engine stream, which aborts its
    request in the core. The first error (ValueError, EngineDeadError, ...) cancels the other
    prompts and is raised as such, never wrapped in an exception group.
    """
    if len(prompts) == 1:
        await _run_one(
            state, 0, prompts[0], params, request_id, priority, arrival, on_output, lora_request
        )
        return
    failures: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def guarded(index: int, prompt: EnginePrompt) -> None:
            try:
                await _run_one(
                    state, index, prompt, params, f"{request_id}-{index}", priority, arrival,
                    on_output, lora_request,
                )  # fmt: skip
            except Exception as exc:
                failures.append(exc)
                tg.cancel_scope.cancel()

        for index, prompt in enumerate(prompts):
            tg.start_soon(guarded, index, prompt)
    if failures:
        raise failures[0]


async def _run_one(
    state: ServerState,
    index: int,
    prompt: EnginePrompt,
    params: SamplingParams,
    request_id: str,
    priority: int,
    arrival: float,
    on_output: OnOutput,
    lora_request: LoRARequest | None = None,
) -> None:
    tracker = state.metrics.track(len(prompt.token_ids), params.n, arrival)
    state.in_flight.add(request_id)
    try:
        stream = state.engine.generate(
            prompt.token_ids, params, request_id=request_id, priority=priority,
            lora_request=lora_request,
        )  # fmt: skip
        async with aclosing(stream):  # closing it early aborts the request
            async for output in stream:
                tracker.observe(output)
                await on_output(index, output)
    finally:
        state.in_flight.discard(request_id)
        tracker.close()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created_now() -> int:
    return int(time.time())
