"""The wire protocol: typed msgpack frames, malformed frames refused, no pickle, 0700 dir."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import msgspec
import pytest

from asyncengine import SamplingParams
from asyncengine.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    FinishReason,
    HandshakeAddresses,
    HandshakeFailed,
    HandshakeHello,
    HandshakeReady,
    UtilityCall,
    UtilityResult,
)
from asyncengine.ipc.serial import (
    MalformedFrameError,
    MsgpackEncoder,
    RequestDecoder,
    encode_request,
    handshake_decoder,
    outputs_decoder,
)
from asyncengine.ipc.sockets import make_private_socket_dir, remove_socket_dir
from asyncengine.sampling_params import CoreSamplingParams

REQUEST = EngineCoreRequest(
    request_id="r1",
    prompt_token_ids=[1, 2, 3],
    sampling_params=SamplingParams(temperature=0.5, max_tokens=7, stop=["x"], seed=3),
    arrival_time=12.5,
    priority=-2,
)


@pytest.mark.parametrize(
    ("request_type", "payload"),
    [
        (EngineCoreRequestType.ADD, REQUEST),
        (EngineCoreRequestType.ABORT, ["a", "b#1"]),
        (EngineCoreRequestType.UTILITY, UtilityCall(7, "statistics")),
        (EngineCoreRequestType.UTILITY, UtilityCall(8, "reset_prefix_cache", [1, "x"])),
    ],
)
def test_request_frames_round_trip(request_type: EngineCoreRequestType, payload: object) -> None:
    frames = encode_request(MsgpackEncoder(), request_type, payload)  # type: ignore[arg-type]
    assert frames[0] == request_type.value and len(frames[0]) == 1
    decoded_type, decoded = RequestDecoder().decode(frames)
    assert decoded_type is request_type
    # The same fields; a request's SamplingParams arrives as the core's CoreSamplingParams.
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(payload)


def test_the_core_decodes_sampling_params_without_validating_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    validate = SamplingParams.validate

    def counting(self: SamplingParams) -> None:
        nonlocal calls
        calls += 1
        validate(self)

    monkeypatch.setattr(SamplingParams, "validate", counting)
    frames = encode_request(MsgpackEncoder(), EngineCoreRequestType.ADD, REQUEST)
    _, decoded = RequestDecoder().decode(frames)
    assert calls == 0  # validated once, by the client, when it was built
    assert type(decoded.sampling_params) is CoreSamplingParams
    assert decoded.sampling_params.temperature == 0.5


def test_outputs_round_trip_with_utility_result_and_engine_dead() -> None:
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [5, 6], new_logprobs=[([5, 9], [-0.1, -2.5], 1)]),
            EngineCoreOutput("b", [7], finish_reason=FinishReason.STOP, stop_reason=7),
        ],
        timestamp=time.monotonic(),
        utility_output=UtilityResult(3, result={"x": [1, 2]}),
    )
    assert outputs_decoder.decode(MsgpackEncoder().encode(outputs)) == outputs
    dead = EngineCoreOutputs(engine_dead="RuntimeError: boom")
    assert outputs_decoder.decode(MsgpackEncoder().encode(dead)).engine_dead == dead.engine_dead


def test_encode_into_reuses_one_buffer() -> None:
    encoder, buffer = MsgpackEncoder(), bytearray()
    for n in (50, 3):
        outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", list(range(n)))])
        encoder.encode_into(outputs, buffer)
        assert outputs_decoder.decode(buffer) == outputs


def test_handshake_messages_are_tagged() -> None:
    enc = MsgpackEncoder()
    for message in (
        HandshakeHello(pid=42),
        HandshakeAddresses("ipc:///tmp/x/input", ["ipc:///tmp/x/output"]),
        HandshakeReady(num_kv_blocks=10),
        HandshakeFailed(error="ValueError: no weights"),
    ):
        assert handshake_decoder.decode(enc.encode(message)) == message


def test_engine_stats_hit_rate_and_used_blocks() -> None:
    stats = EngineStats(
        num_running_reqs=1,
        num_waiting_reqs=2,
        num_preemptions=0,
        num_kv_blocks=10,
        num_free_kv_blocks=7,
        kv_cache_usage=0.3,
        prefix_cache_queries=40,
        prefix_cache_hits=10,
    )
    assert stats.num_used_kv_blocks == 3 and stats.prefix_cache_hit_rate == 0.25
    again = msgspec.convert(msgspec.to_builtins(stats), EngineStats)
    assert again == stats


MALFORMED = [
    [b"\x00"],  # one frame
    [b"\x00", b"a", b"b"],  # three frames
    [b"\x09", b"\x90"],  # unknown type
    [b"", b"\x90"],  # empty type
    [b"\x00\x00", b"\x90"],  # two-byte type
    [EngineCoreRequestType.EXECUTOR_FAILED.value, b""],  # only the core may say this
    [b"\x00", b"not msgpack \xc1"],
    [b"\x00", msgspec.msgpack.encode(["r1", [1, 2]])],  # an ADD missing fields
    [b"\x00", msgspec.msgpack.encode(["r1", [1, "x"], {}, 0.0])],  # a string token id
    [b"\x01", msgspec.msgpack.encode([1, 2])],  # ABORT of non-string ids
    [b"\x02", msgspec.msgpack.encode({"call_id": 1})],  # UTILITY of the wrong shape
    [b"\x00", msgspec.msgpack.encode(["r1", [1], {"temperature": "hot"}, 0.0])],  # wrong type
]
# Values in range are the client's to check (SamplingParams.validate, at construction and at
# generate()): the core trusts them rather than validating every request again.


@pytest.mark.parametrize("frames", MALFORMED)
def test_malformed_frames_raise_malformed_frame_error(frames: list[bytes]) -> None:
    with pytest.raises(MalformedFrameError):
        RequestDecoder().decode(frames)


def test_nothing_is_pickled() -> None:
    class Arbitrary:
        pass

    # The encoder knows only msgspec-encodable types: an arbitrary object cannot go out...
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(UtilityCall(1, "x", [Arbitrary()]))
    # ...and a pickle coming in is just a malformed frame.
    import pickle

    with pytest.raises(MalformedFrameError):
        RequestDecoder().decode([b"\x02", pickle.dumps(UtilityCall(1, "statistics"))])


def test_socket_dir_is_private() -> None:
    path = make_private_socket_dir()
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o700
        assert os.stat(path).st_uid == os.getuid()
    finally:
        remove_socket_dir(path)
    assert not path.exists()


def test_socket_dirs_of_dead_processes_are_swept() -> None:
    import subprocess
    import sys
    import tempfile

    from asyncengine.ipc.sockets import make_private_socket_dir, sweep_stale_socket_dirs

    # A process that made its directory and died without cleaning up (as after SIGKILL).
    code = "from asyncengine.ipc.sockets import make_private_socket_dir as m; print(m())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    left = Path(out.stdout.strip())
    assert left.is_dir() and left.parent == Path(tempfile.gettempdir())
    mine = make_private_socket_dir()  # sweeps on the way
    try:
        assert not left.exists()
        assert mine.is_dir() and sweep_stale_socket_dirs() == 0  # a live process's stays
    finally:
        remove_socket_dir(mine)
