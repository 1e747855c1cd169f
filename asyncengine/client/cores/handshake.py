"""Handshake: an engine core's start-up conversation with whoever launched it.

The core (`python -m asyncengine.core.engine_core_proc`) says HELLO on a ROUTER socket bound
here; it is told where to bind its input socket and where its clients' output sockets are;
it answers READY (model loaded, KV cache allocated) or FAILED with the root cause. The same
for a local process and for a Ray actor's (over tcp://).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import msgspec
import zmq

from asyncengine.client.cores.handle import CoreHandle
from asyncengine.errors import EngineStartupError
from asyncengine.ipc.messages import (
    HandshakeAddresses,
    HandshakeFailed,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
)
from asyncengine.ipc.serial import MsgpackEncoder, handshake_decoder
from asyncengine.ipc.sockets import make_socket

# A FAILED message sent just before the core's exit may still be in flight this long.
_FAILED_IN_FLIGHT_S = 0.5


class Handshake:
    """The handshake socket of one core (`address`: where the core says HELLO).

    `alive` and `exit_desc` tell, while it waits, whether the core is still running and how
    it ended: a core that exits during start-up fails it at once.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        *,
        name: str,
        startup_timeout: float,
        alive: Callable[[], bool],
        exit_desc: Callable[[], str],
    ) -> None:
        self.name = name
        self.startup_timeout = startup_timeout
        self._alive = alive
        self._exit_desc = exit_desc
        self._socket = make_socket(ctx, address, zmq.ROUTER, bind=True)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = MsgpackEncoder()
        self._deadline = 0.0

    def start_clock(self) -> None:
        """The core is launched: it has `startup_timeout` seconds from now to be READY."""
        self._deadline = time.monotonic() + self.startup_timeout

    async def run(self, input_address: str, output_addresses: list[str]) -> HandshakeReady:
        """HELLO → the addresses → READY (then the core has bound its input socket)."""
        identity, hello = await self._recv()
        if not isinstance(hello, HandshakeHello):
            raise EngineStartupError(f"{self.name} sent {type(hello).__name__} before HELLO")
        addresses = HandshakeAddresses(input_address, output_addresses)
        self._socket.send_multipart([identity, self._encoder.encode(addresses)])
        _, message = await self._recv()
        if isinstance(message, HandshakeFailed):
            raise EngineStartupError(f"{self.name} failed to start: {message.error}")
        if not isinstance(message, HandshakeReady):
            raise EngineStartupError(f"{self.name} sent {type(message).__name__}, not READY")
        self.close()
        return message

    async def _recv(self) -> tuple[bytes, HandshakeMessage]:
        sock, deadline = self._socket, self._deadline
        died_at: float | None = None
        while True:
            try:
                identity, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                try:
                    return identity, handshake_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    raise EngineStartupError(f"malformed handshake message: {exc}") from exc
            if readable(sock):
                continue
            now = time.monotonic()
            if not self._alive():
                died_at = died_at or now
                if now - died_at > _FAILED_IN_FLIGHT_S:
                    raise EngineStartupError(
                        f"{self.name} process exited during start-up ({self._exit_desc()}); "
                        "see its log above for the cause"
                    )
            if now > deadline:
                raise EngineStartupError(
                    f"{self.name} did not become ready within {self.startup_timeout} s"
                )
            with anyio.move_on_after(min(0.1, deadline - now)):
                await anyio.wait_readable(socket_fd(sock))

    def close(self) -> None:
        self._socket.close(linger=0)


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's edge-triggered notification FD (readable when its events may have changed)."""
    return int(sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket[bytes]) -> bool:
    # Reading EVENTS also re-arms the FD's edge: check it before waiting again.
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


class HandshakeCore(CoreHandle):
    """A core that this client launches and meets through a `Handshake` (a process of its
    own, or a Ray actor's): both get ready the same way."""

    _handshake: Handshake

    async def wait_ready(self, output_addresses: list[str]) -> None:
        await self.launch()
        ready = await self._handshake.run(self.input_address, output_addresses)
        self.num_kv_blocks = ready.num_kv_blocks
        self.input_address = ready.input_address or self.input_address
