"""ZMQ socket helpers shared by the client and the core: addresses in a private directory."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import zmq


def make_private_socket_dir() -> Path:
    """A fresh directory only this user can enter (0700), for ipc:// socket files."""
    path = Path(tempfile.mkdtemp(prefix="asyncengine-"))
    os.chmod(path, stat.S_IRWXU)  # mkdtemp makes it 0700 already; make the contract explicit
    return path


def remove_socket_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc_address(socket_dir: Path, name: str) -> str:
    return f"ipc://{socket_dir / name}"


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    socket_type: int,
    *,
    bind: bool,
    linger_ms: int = 0,
) -> zmq.Socket[bytes]:
    """A socket bound or connected to `address`, with unbounded queues (the engine applies its
    own back-pressure: requests are admitted by the scheduler, outputs merge per stream)."""
    sock: zmq.Socket[bytes] = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
