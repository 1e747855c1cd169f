"""Bad requests hurt only themselves, also after they reach the engine: a request whose
output cannot be processed (here, its detokenisation raises) ends with EngineGenerateError
naming it and the cause, while the engine and every other request go on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import AsyncLLM, EngineGenerateError, SamplingParams
from asyncengine.client.detokenizer import IncrementalDetokenizer
from asyncengine.outputs import RequestOutput
from asyncengine.testing import fault_injection

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON = [7, 7, 7, 7]  # a prompt the patched detokenizer refuses to follow


@pytest.fixture
def poisoned_detokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Detokenisers of requests whose prompt is POISON raise on their first tokens."""
    poisoned: set[int] = set()
    original_init, original_update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update

    def init(self: IncrementalDetokenizer, tokenizer: Any, prompt: Sequence[int], p: Any) -> None:
        original_init(self, tokenizer, prompt, p)
        if list(prompt) == POISON:
            poisoned.add(id(self))

    def update(self: IncrementalDetokenizer, token_ids: Sequence[int]) -> Any:
        if id(self) in poisoned:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original_update(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)


async def _bad_beside_three_good(
    engine: AsyncLLM, bad_prompt: list[int]
) -> tuple[list[RequestOutput], list[EngineGenerateError]]:
    """Request "bad" and three good ones, concurrently: the good ones' final outputs, and the
    errors raised."""
    finals: list[RequestOutput] = []
    errors: list[EngineGenerateError] = []

    async def one(prompt: list[int], request_id: str) -> None:
        try:
            async for out in engine.generate(prompt, PARAMS, request_id=request_id):
                if out.finished:
                    finals.append(out)
        except EngineGenerateError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, bad_prompt, "bad")
        for i in range(3):
            tg.start_soon(one, [1, 2, 3 + i], f"good-{i}")
    return finals, errors


@pytest.mark.parametrize("core", ["process", "thread"])
async def test_a_failing_request_ends_alone(
    tiny_llama: Path, poisoned_detokenizer: None, core: str
) -> None:
    async with AsyncLLM.from_pretrained(tiny_llama, core=core, **ENGINE_KW) as engine:
        finals, errors = await _bad_beside_three_good(engine, POISON)
        assert len(errors) == 1 and len(finals) == 3
        assert "request 'bad' failed" in str(errors[0]) and "UnicodeDecodeError" in str(errors[0])
        assert all(len(f.outputs[0].token_ids) == 12 for f in finals)
        assert not engine.errored
        await engine.check_health()
        stats = await wait_until_idle(engine)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # the bad one's blocks too


async def test_nan_logits_fail_their_request_alone(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(*fault_injection.ENV)
    async with AsyncLLM.from_pretrained(tiny_llama, **ENGINE_KW) as engine:
        await engine._call_utility("testing_nan_logits", "bad")
        finals, errors = await _bad_beside_three_good(engine, [9, 9, 9])
        assert len(errors) == 1 and len(finals) == 3
        assert "request 'bad' failed in the engine" in str(errors[0])
        assert "NaN" in str(errors[0])
        assert not engine.errored
        stats = await wait_until_idle(engine)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
