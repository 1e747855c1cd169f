"""Starting and stopping the servers that `http_load.py` drives: `asyncengine
serve`, `vllm serve` and llama.cpp's `llama-server`.

Each server runs as a child process in a process group of its own, its output in a log file,
until the `running_server` block ends; then the whole group is stopped (engine cores and
workers included), whatever happened inside the block. Command builders give asyncengine's and
vLLM's command lines; llama-server's comes from its caller (the module that builds llama.cpp
knows the binary and the GGUF).

Imports only the standard library and psutil, so it runs in any peer's interpreter.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil


class ServerError(RuntimeError):
    """A server exited before it was ready, or was not ready in time; the message ends with
    the tail of its log."""


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A server that answered its readiness check."""

    base_url: str  # http://127.0.0.1:PORT, without /v1
    ready_s: float  # seconds from the process's start to its first ready answer
    pid: int
    log_path: Path


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (another process may take it before the
    server binds it: a small race, accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def asyncengine_command(
    model: str | Path,
    port: int,
    *,
    served_model_name: str,
    python: str = sys.executable,
    dtype: str = "bfloat16",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`asyncengine serve MODEL` on 127.0.0.1:`port` under the interpreter `python`, without an
    access log (a line per request would cost the server time the others do not spend)."""
    return [
        python, "-m", "asyncengine.entrypoints.cli", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--no-access-log", "--served-model-name", served_model_name, *extra_args,
    ]  # fmt: skip


def vllm_command(
    model: str | Path,
    port: int,
    *,
    served_model_name: str,
    python: str,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`vllm serve MODEL` on 127.0.0.1:`port` under `python` (vLLM's virtualenv), with the
    settings of runner.py's in-process vLLM runs (eager, max_model_len 2048, seed 0).

    Only long-standing flags: `--disable-uvicorn-access-log` silences the per-request access
    log. Request logging is left at vLLM's default: off in recent vLLM, where
    `--enable-log-requests` replaced the deprecated `--disable-log-requests` (vllm#21739); an
    older vLLM logs every request unless given `--disable-log-requests` in `extra_args`.
    """
    return [
        python, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--served-model-name", served_model_name, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--seed", "0", "--disable-uvicorn-access-log", *extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    base_url: str,
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    ready_timeout: float = 300.0,
    ready_paths: Sequence[str] = ("/health",),
    stop_timeout: float = 30.0,
) -> Iterator[RunningServer]:
    """Run `command` (a server that will listen at `base_url`) for the duration of the block.

    Ready means every path in `ready_paths` answers 200 (all three servers answer /health
    only once the model is loaded: llama-server says 503 while loading, the others do not
    listen yet). Raises ServerError, with the tail of the log, when the process exits first or
    is not ready within `ready_timeout` seconds, and before starting it if something already
    answers at `base_url` (its answers would be taken for the new server's).

    On leaving, always: SIGTERM to the process group, up to `stop_timeout` seconds for it to
    empty, then SIGKILL to whatever is left. The log (`log_path`, else a temporary file) is
    kept.
    """
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    if _answers(host, port):
        raise ServerError(f"something already listens at {base_url}")
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"server-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with log_path.open("wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,  # its own process group: stop() reaches its children
        )
    try:
        _wait_ready(proc, host, port, ready_paths, ready_timeout, log_path)
        yield RunningServer(base_url, time.perf_counter() - start, proc.pid, log_path)
    finally:
        _stop_group(proc, stop_timeout)


def log_tail(path: Path, max_chars: int = 4000) -> str:
    """The end of a log file (empty when it cannot be read)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-max_chars:].decode(errors="replace")


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _status(host: str, port: int, path: str) -> int | None:
    """The status of GET `path`, None when nothing answers. http.client, not urllib: urllib
    would send a loopback request through an http_proxy from the environment."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _wait_ready(
    proc: subprocess.Popen[bytes],
    host: str,
    port: int,
    paths: Sequence[str],
    timeout: float,
    log_path: Path,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerError(
                f"{proc.args!r} exited with status {proc.returncode} before it was ready; "
                f"the end of {log_path}:\n{log_tail(log_path)}"
            )
        if all(_status(host, port, p) == 200 for p in paths):
            return
        if time.monotonic() > deadline:
            raise ServerError(
                f"{proc.args!r} was not ready in {timeout:.0f} s (GET {', '.join(paths)}); "
                f"the end of {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.2)


_KILL_WAIT_S = 5.0


def _stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM to `proc`'s process group; after `timeout` seconds, SIGKILL to what is left.

    The group, not only `proc`: a server whose leader died leaves its engine core and workers
    running, holding memory and cores that the next server would then share.
    """
    pgid = proc.pid  # start_new_session: the leader's pid is the group's id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    while _live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None or _live_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        # SIGKILL is asynchronous: on a loaded machine an orphaned member can still be running
        # for a moment after the leader is reaped, holding the cores the next server needs.
        killed_by = time.monotonic() + _KILL_WAIT_S
        while _live_members(pgid) and time.monotonic() < killed_by:
            time.sleep(0.05)


def _live_members(pgid: int) -> list[int]:
    """The pids of the group's processes that have not exited. Zombies do not count: an orphan
    whose new parent does not reap it (a container's init may not) would otherwise look alive
    until the deadline."""
    pids = []
    for p in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                pids.append(p.pid)
    return pids
