"""Typed msgpack encoding of the wire types; never pickle.

Client → core messages are two frames, `[request type (1 byte), payload]`; core → client
messages are one `EngineCoreOutputs` frame. Every payload is decoded against its exact type, so
a frame that is not what it claims to be raises `MalformedFrameError` and is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.ipc.messages import (
    EngineCoreLaunch,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HandshakeMessage,
    UtilityCall,
)

RequestPayload = EngineCoreRequest | list[str] | UtilityCall


class MalformedFrameError(ValueError):
    """A message that does not decode as the type its header names."""


class MsgpackEncoder:
    """msgpack encoder that can encode into a reused buffer (the output IO thread's hot path)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)

    def encode_into(self, obj: Any, buffer: bytearray) -> None:
        """Encode `obj` into `buffer`, resized to fit (its capacity is kept between calls)."""
        self._encoder.encode_into(obj, buffer)


_WIRE_TYPES = {
    EngineCoreRequestType.ADD: EngineCoreRequest,
    EngineCoreRequestType.ABORT: list[str],
    EngineCoreRequestType.UTILITY: UtilityCall,
}


class RequestDecoder:
    """Decodes client → core frames into (request type, typed payload)."""

    def __init__(self) -> None:
        self._decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
            t.value: msgspec.msgpack.Decoder(typ) for t, typ in _WIRE_TYPES.items()
        }

    def decode(self, frames: Sequence[bytes | memoryview]) -> tuple[EngineCoreRequestType, Any]:
        if len(frames) != 2:
            raise MalformedFrameError(f"expected 2 frames (type, payload), got {len(frames)}")
        type_frame = bytes(frames[0])
        decoder = self._decoders.get(type_frame)
        if decoder is None:
            # EXECUTOR_FAILED exists only inside the core: from a socket it is unknown.
            raise MalformedFrameError(f"unknown request type {type_frame[:8]!r}")
        try:
            payload = decoder.decode(frames[1])
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise MalformedFrameError(
                f"bad {EngineCoreRequestType(type_frame).name} payload: {exc}"
            ) from exc
        return EngineCoreRequestType(type_frame), payload


def encode_request(
    encoder: MsgpackEncoder, request_type: EngineCoreRequestType, payload: RequestPayload
) -> list[bytes]:
    """The frames of one client → core message."""
    return [request_type.value, encoder.encode(payload)]


outputs_decoder: msgspec.msgpack.Decoder[EngineCoreOutputs] = msgspec.msgpack.Decoder(
    EngineCoreOutputs
)
launch_decoder: msgspec.msgpack.Decoder[EngineCoreLaunch] = msgspec.msgpack.Decoder(
    EngineCoreLaunch
)
handshake_decoder: msgspec.msgpack.Decoder[HandshakeMessage] = msgspec.msgpack.Decoder(
    HandshakeMessage  # type: ignore[arg-type]
)


def encode_config(config: EngineConfig) -> bytes:
    """The config as a process the engine spawns receives it (msgpack, not pickle)."""
    return msgspec.msgpack.encode(config)


def decode_config(config_msg: bytes) -> EngineConfig:
    """The inverse of `encode_config`, in the spawned process."""
    return msgspec.msgpack.decode(config_msg, type=EngineConfig)
