"""Engine-death checks for tests: streams open while something kills the engine."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from asyncengine.client.async_llm import AsyncLLM
from asyncengine.errors import EngineDeadError
from asyncengine.sampling_params import SamplingParams

# Long enough that every stream is still running when the engine is killed.
LONG_GREEDY = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)


async def kill_while_streaming(
    engine: AsyncLLM,
    kill: Callable[[], None],
    num_streams: int = 4,
    params: SamplingParams = LONG_GREEDY,
) -> tuple[list[EngineDeadError], float]:
    """Open `num_streams` streams, call `kill` once all have output, and collect what each
    stream raises; returns the errors and the seconds from the kill to the last stream's error.
    """
    errors: list[EngineDeadError] = []
    started = 0
    all_streaming = anyio.Event()
    killed_at = 0.0
    last_error_at = 0.0

    async def consume(i: int) -> None:
        nonlocal started, last_error_at
        counted = False
        try:
            async for _ in engine.generate(f"hello {i}", params):
                if not counted:
                    counted, started = True, started + 1
                    if started == num_streams:
                        all_streaming.set()
        except EngineDeadError as exc:
            errors.append(exc)
            last_error_at = time.monotonic()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(num_streams):
                tg.start_soon(consume, i)
            await all_streaming.wait()
            killed_at = time.monotonic()
            kill()
    return errors, last_error_at - killed_at
