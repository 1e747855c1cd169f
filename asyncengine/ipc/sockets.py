"""ZMQ socket helpers shared by the client and the core: addresses in a private directory."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import zmq

_PREFIX = "asyncengine-"


def make_private_socket_dir() -> Path:
    """A fresh directory only this user can enter (0700), for ipc:// socket files.

    Its name carries this process's pid, so that directories left behind by a process that
    was killed (SIGKILL leaves no `finally`) are swept here, by the next engine's start.
    """
    sweep_stale_socket_dirs()
    path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
    os.chmod(path, stat.S_IRWXU)  # mkdtemp makes it 0700 already; make the contract explicit
    return path


def sweep_stale_socket_dirs() -> int:
    """Remove this user's socket directories whose creating process is gone; how many.

    A process is looked up by pid in this pid namespace: processes that share a temporary
    directory across pid namespaces (containers with a shared /tmp) should each set TMPDIR.
    """
    removed = 0
    uid = os.getuid()
    for entry in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*-*"):
        pid_text = entry.name[len(_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            if entry.is_dir() and entry.stat().st_uid == uid:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to look at
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and its directory is not ours anyway
    return True


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
