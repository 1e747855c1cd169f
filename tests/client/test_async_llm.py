"""AsyncLLM over a real spawned engine-core process: streams as a user sees them.

One engine per module (and backend); every test leaves it idle with its KV blocks free.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import zmq
from async_helpers import ENGINE_KW, wait_until_idle

from asyncengine import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from asyncengine.client.cores.proc_client import ProcCoreClient
from asyncengine.outputs import RequestOutput

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["hello world", "the engine is fast", "a", "async token cache block model of the world"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(tiny_llama, **ENGINE_KW)


@pytest.fixture(scope="module")
def reference(offline: LLM) -> dict[str, list[int]]:
    outs = offline.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_pretrained(tiny_llama, core="process", **ENGINE_KW) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def _idle_after(engine: AsyncLLM) -> AsyncIterator[None]:
    yield
    stats = await wait_until_idle(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def _collect(engine: AsyncLLM, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


async def test_greedy_stream_equals_offline_tokens(
    engine: AsyncLLM, reference: dict[str, list[int]]
) -> None:
    outs = await _collect(engine, PROMPTS[1], GREEDY)
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert final.token_ids == reference[PROMPTS[1]]
    assert final.finish_reason == "length"
    # CUMULATIVE: every output extends the previous one.
    for a, b in itertools.pairwise(outs):
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    tok = engine.tokenizer
    full = tok.decode(outs[-1].prompt_token_ids + final.token_ids)
    assert final.text == full[len(tok.decode(outs[-1].prompt_token_ids)) :]
    assert outs[-1].prompt == PROMPTS[1]


async def test_delta_outputs_concatenate_to_the_final_text(
    engine: AsyncLLM, reference: dict[str, list[int]]
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    outs = await _collect(engine, PROMPTS[0], params)
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert tokens == reference[PROMPTS[0]]
    cumulative = await _collect(engine, PROMPTS[0], GREEDY)
    assert "".join(o.outputs[0].text for o in outs) == cumulative[-1].outputs[0].text


async def test_final_only_yields_once(engine: AsyncLLM, reference: dict[str, list[int]]) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    outs = await _collect(engine, PROMPTS[3], params)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == reference[PROMPTS[3]]


async def test_slow_delta_consumer_gets_merged_outputs(
    engine: AsyncLLM, reference: dict[str, list[int]]
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    async with aclosing(engine.generate(PROMPTS[2], params)) as stream:
        first = await stream.__anext__()
        # Don't read while the request runs to the end: its outputs wait, merged into one.
        await wait_until_idle(engine)
        rest = [out async for out in stream]
    # Everything produced while nobody read comes as one merged output; if the consumer was
    # scheduled late, even the first read may already hold the whole request.
    outs = [first, *rest]
    assert len(outs) <= 2 and outs[-1].finished
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert tokens == reference[PROMPTS[2]]


async def test_n_sequences_stream_with_indexes(engine: AsyncLLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    outs = await _collect(engine, "hello", params)
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


async def test_stop_string_cuts_the_text_and_frees_the_request(engine: AsyncLLM) -> None:
    base = (await _collect(engine, PROMPTS[0], GREEDY))[-1].outputs[0].text
    stop = base[4:8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    outs = await _collect(engine, PROMPTS[0], params)
    final = outs[-1].outputs[0]
    assert final.text == base[: base.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    # Held back: no output ever showed the start of the stop string.
    assert all(stop not in o.outputs[0].text for o in outs)


async def test_token_id_prompt_and_priority(engine: AsyncLLM) -> None:
    outs = await _collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[-1].prompt is None and outs[-1].prompt_token_ids == [5, 6, 7]
    outs = [o async for o in engine.generate("hello", GREEDY, priority=3)]
    assert outs[-1].finished


@pytest.mark.timeout(180)
async def test_64_concurrent_streams_with_early_exits(engine: AsyncLLM, offline: LLM) -> None:
    rng = random.Random(1234)
    words = "the a of and to in is it that hello world engine token cache block fast".split()  # noqa: SIM905
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    leavers = set(rng.sample(range(64), 16))  # a quarter leave early, in three ways
    results: dict[int, list[int]] = {}

    class Leave(Exception):
        pass

    async def consume(i: int) -> None:
        way = i % 3
        leave_after = rng.randint(1, 6)
        n = 0
        if i in leavers and way == 0:  # break out of the loop
            async for _ in engine.generate(prompts[i], params, request_id=f"s{i}"):
                n += 1
                if n == leave_after:
                    break
        elif i in leavers and way == 1:  # cancelled from outside
            with anyio.move_on_after(0.001 * leave_after):
                async for _ in engine.generate(prompts[i], params, request_id=f"s{i}"):
                    pass
        elif i in leavers:  # an exception in the consumer
            try:
                async for _ in engine.generate(prompts[i], params, request_id=f"s{i}"):
                    n += 1
                    if n == leave_after:
                        raise Leave
            except Leave:
                pass
        else:
            async for out in engine.generate(prompts[i], params, request_id=f"s{i}"):
                if out.finished:
                    results[i] = out.outputs[0].token_ids

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(consume, i)
    assert sorted(results) == sorted(set(range(64)) - leavers)
    for i, tokens in results.items():
        assert tokens == expected[i], f"stream {i} differs from offline greedy"
    # The autouse fixture checks that every KV block is free again.


async def test_break_aborts_the_request_in_the_core(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async for _ in engine.generate("hello", params, request_id="breaker"):
        break
    # The generator is closed when collected (or at once with contextlib.aclosing); the
    # request then leaves the core: the autouse fixture waits for that.
    await wait_until_idle(engine)


async def test_cancelled_task_group_aborts_its_streams(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    started = 0
    all_streaming = anyio.Event()

    async def consume(i: int) -> None:
        nonlocal started
        async for _ in engine.generate(f"hello {i}", params):
            started += 1
            if started == 8:
                all_streaming.set()

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(consume, i)
        await all_streaming.wait()
        tg.cancel_scope.cancel()
    stats = await wait_until_idle(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_abort_ends_the_stream_with_abort(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = []
    async for out in engine.generate("hello", params, request_id="to-abort"):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("to-abort")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    engine.abort("no-such-request")  # unknown ids are ignored


async def test_duplicate_live_request_id_is_refused(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with aclosing(engine.generate("hello", params, request_id="dup")) as first:
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate("other", params, request_id="dup").__anext__()
    # Once it is gone the id can be used again.
    outs = [o async for o in engine.generate("hi", GREEDY, request_id="dup")]
    assert outs[-1].finished


async def test_bad_requests_raise_value_error_for_their_sender_only(engine: AsyncLLM) -> None:
    async def bad(prompt: object, params: object = None, **kw: object) -> None:
        async for _ in engine.generate(prompt, params, **kw):  # type: ignore[arg-type]
            pass

    # Long enough to be running still after its first read: 12 tokens could all be out by
    # then on a fast engine (the whole request merged into that read).
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with anyio.fail_after(60):
        async with aclosing(engine.generate("hello", long)) as good:
            first = await good.__anext__()
            for args, kw, match in [
                (("",), {}, "empty"),
                (([1, 10**9],), {}, "vocabulary"),
                (("hello", "not params"), {}, "SamplingParams"),
                ((list(range(1, 300)),), {}, "max_model_len"),
                (("hello",), {"request_id": ""}, "request_id"),
                (("hello",), {"priority": 1.5}, "priority"),
                ((b"bytes",), {}, "prompt must be"),
            ]:
                with pytest.raises(ValueError, match=match):
                    await bad(*args, **kw)
            rest = [o async for o in good]
    assert not first.finished and rest[-1].finished


async def test_malformed_frames_on_the_input_socket_do_not_hurt(engine: AsyncLLM) -> None:
    client = engine._core_client
    assert isinstance(client, ProcCoreClient)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(client.cores[0].input_address)
    for frames in ([b"\x05", b"junk"], [b"\x00", b"\xc1\xc1"], [b"\x03", b""], [b"x"]):
        sock.send_multipart(frames, zmq.NOBLOCK)
    sock.close(linger=2000)
    ctx.term()
    await anyio.sleep(0.2)
    await engine.check_health()
    outs = [o async for o in engine.generate("hello", GREEDY)]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    assert client.proc is not None and client.proc.is_alive()


async def test_health_stats_and_prefix_cache(engine: AsyncLLM) -> None:
    await engine.check_health(timeout=10)
    assert await engine.reset_prefix_cache()
    long_prompt = " ".join(["hello world the engine"] * 12)
    for _ in range(2):
        [o async for o in engine.generate(long_prompt, GREEDY)]
    stats = await engine.get_stats()
    assert stats.num_kv_blocks == engine.config.cache_config.num_kv_blocks == 512
    assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate <= 1
    assert not engine.errored and engine.dead_error is None
    assert engine.config.model_config.max_model_len == 256
