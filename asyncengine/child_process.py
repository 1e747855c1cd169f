"""ChildProcess: how the engine starts its processes (the engine core, tensor-parallel workers).

Each is a fresh interpreter running `python -m <module>` of ours. Unlike multiprocessing's
spawn, it never imports the application's `__main__` module, so an application needs no
`if __name__ == "__main__":` guard: a plain script, `python -c`, a script piped on stdin, a
notebook or a uvicorn app module all work as they are.

Two pipes connect parent and child:

- the child's stdin carries its start-up arguments (`payload`, length-prefixed bytes), then
  stays open: its end of file tells the child that its parent is gone (`process_setup`);
- an exit pipe, whose write end only the child holds: its read end (`sentinel`) becomes
  readable when the child exits, so a parent can wait on it in an event loop or a `select`.

A child starts with SIGINT blocked. A terminal's Ctrl-C goes to the whole foreground process
group, children included, but the engine's owner is the one to act on it (it stops its
children in order, after a drain when serving); a child that is still importing when it
arrives must not die of it with a KeyboardInterrupt traceback. The child sets SIGINT aside
for good (`process_setup.install_signal_handlers`), which discards one held pending, then
unblocks it.

The interface follows `multiprocessing.Process` (`start`, `pid`, `name`, `sentinel`,
`exitcode`, `is_alive`, `join`, `terminate`, `kill`), so callers read the same.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import site
import struct
import subprocess
import sys
from pathlib import Path

# The folder that holds the asyncengine package: the child imports the same copy as the
# parent, installed or not (a checkout on sys.path, say).
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_LENGTH = struct.Struct("<Q")


def _child_env() -> dict[str, str]:
    """The parent's environment, with the package's folder on PYTHONPATH unless it is a
    site-packages folder (the child finds it there anyway, and a site folder put ahead of
    the standard library could shadow it)."""
    env = dict(os.environ)
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if _PACKAGE_PARENT not in {str(Path(d).resolve()) for d in site_dirs}:
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
    return env


class ChildProcess:
    """`python -m module` in a new interpreter, started with `payload` on its stdin."""

    def __init__(
        self, module: str, payload: bytes, *, name: str, pass_fds: tuple[int, ...] = ()
    ) -> None:
        self.module = module
        self.name = name
        self._payload = payload
        self._pass_fds = pass_fds  # more descriptors the child inherits (a listening socket)
        self._popen: subprocess.Popen[bytes] | None = None
        self.sentinel = -1  # the exit pipe's read end, once started

    def start(self) -> None:
        """Start the child and hand it its payload (blocks for a few milliseconds)."""
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was started already")
        # The signal mask is per thread and survives fork and exec: the child starts with
        # SIGINT blocked (see the module's docstring). This thread's own mask is put back
        # last, so that a Ctrl-C it held lands once the child is started and known.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._spawn()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _spawn(self) -> None:
        exit_r, exit_w = os.pipe()
        env = _child_env()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", self.module],
                stdin=subprocess.PIPE,
                pass_fds=(exit_w, *self._pass_fds),
                env=env,
            )
        except BaseException:
            os.close(exit_r)
            raise
        finally:
            os.close(exit_w)  # the child's copy is the only one: EOF on exit_r when it exits
        self.sentinel = exit_r
        stdin = self._popen.stdin
        assert stdin is not None
        try:
            stdin.write(_LENGTH.pack(len(self._payload)) + self._payload)
            stdin.flush()
        except BrokenPipeError:
            pass  # it died at once; its exit code says why

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status after, negative `-N` if killed by signal N."""
        return self._popen.poll() if self._popen is not None else None

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: forever) for the child to exit."""
        if self._popen is None:
            return
        if self.sentinel >= 0:
            # Wake as the exit pipe closes, rather than Popen.wait's polling (up to 50 ms late).
            readable, _, _ = select.select([self.sentinel], [], [], timeout)
            # The pipe closes as it exits, a moment before it can be reaped.
            timeout = 0.5 if readable else 0
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def terminate(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            with contextlib.suppress(ProcessLookupError):
                self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()

    def close(self) -> None:
        """Release the pipes (the child sees its stdin end: its parent is gone). Idempotent."""
        if self._popen is not None and self._popen.stdin is not None:
            with contextlib.suppress(OSError):
                self._popen.stdin.close()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def read_payload() -> bytes:
    """In the child: the payload its parent wrote to its stdin (see ChildProcess)."""
    stdin = sys.stdin.buffer
    header = stdin.read(_LENGTH.size)
    if len(header) != _LENGTH.size:
        raise RuntimeError("no start-up payload on stdin: this module is started by asyncengine")
    (size,) = _LENGTH.unpack(header)
    payload = stdin.read(size)
    if len(payload) != size:
        raise RuntimeError(f"start-up payload cut short ({len(payload)} of {size} bytes)")
    return payload
