"""Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group, the engine's
processes included. `serve` drains on the first (streams in flight finish normally, new
requests are refused, nothing is reported dead), aborts what is left on the second, and exits
0; `generate` stops with status 130 and one line. Real processes, each in a process group of
its own (as a terminal's job), the steps slowed down so that streams are still in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).parent
SERVE_FLAGS = [
    "--port", "0", "--served-model-name", "tiny", "--no-access-log", "--device", "cpu",
    "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
    "--shutdown-timeout", "120",
]  # fmt: skip
STEP_S = 0.05  # every engine step sleeps this long first (slow_engine_steps.py)
SHORT, LONG = 16, 480  # tokens: about 1 s, and about 24 s (longer than any wait below)


def _slow_env(*, in_core: bool) -> dict[str, str]:
    """slow_engine_steps on the path; `in_core`: the engine core loads it (its processes
    inherit the environment), else the test's process imports it itself."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, SLOW_ENGINE_STEP_S=str(STEP_S), PYTHONPATH=path)
    if in_core:
        env["ASYNCENGINE_TEST_HOOKS"] = "slow_engine_steps"
    return env


@contextlib.contextmanager
def serve_job(
    model: Path, log: Path, *flags: str, servers: int = 1
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`asyncengine serve` as a terminal's job (a process group of its own); yields it and
    its URL once every API server has started."""
    command = [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(model)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, *SERVE_FLAGS, *flags],
            stdout=out,
            stderr=out,
            env=_slow_env(in_core=True),
            start_new_session=True,
        )
    try:
        url = None
        while url is None or log.read_text().count("Application startup complete") < servers:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()}"
            if url is None:
                m = re.search(
                    r"(?:Uvicorn running on http://|serving on )([\d.]+:\d+)", log.read_text()
                )
                url = f"http://{m.group(1)}" if m else None
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Stream(threading.Thread):
    """One streamed completion of `max_tokens` tokens; `started` once its first bytes came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__()
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.body = ""
        self.start()

    def run(self) -> None:
        body = {"prompt": "hi", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            for chunk in r.iter_text():
                self.body += chunk
                self.started.set()

    def finish_reason(self) -> str:
        """The stream's finish_reason; asserts it ends with [DONE] and carries no error."""
        blocks = self.body.removesuffix("\n\n").split("\n\n")
        assert blocks[-1] == "data: [DONE]", self.body[-500:]
        events = [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]
        assert not any("error" in e for e in events), self.body[-500:]
        reason: str = events[-1]["choices"][0]["finish_reason"]
        return reason


def _ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group


def _new_request_is_refused(url: str) -> None:
    """A new request while draining: refused (its connection, or 503), never served."""
    try:
        response = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    except httpx.TransportError:
        return
    assert response.status_code == 503, response.text


@pytest.mark.parametrize("api_servers", [1, 2])
def test_ctrl_c_drains_then_a_second_stops_at_once(
    chat_model: Path, tmp_path: Path, api_servers: int
) -> None:
    log = tmp_path / "serve.log"
    flags = ["--api-server-count", "2"] if api_servers == 2 else []
    with serve_job(chat_model, log, *flags, servers=api_servers) as (proc, url):
        if api_servers == 2:
            # A normal start-up logs at INFO: nothing at WARNING or above.
            start_up = log.read_text()
            assert re.search(r"^INFO \S+api_server_manager: serving on", start_up, re.M)
            assert not re.search(r"WARNING|ERROR", start_up), start_up
        tree = psutil.Process(proc.pid).children(recursive=True)
        short, long = Stream(url, SHORT), Stream(url, LONG)
        assert short.started.wait(60) and long.started.wait(60)

        _ctrl_c(proc)  # the first: a drain
        short.join(60)
        assert not short.is_alive()
        assert short.finish_reason() == "length"  # finished in full, with no error event
        assert long.is_alive()  # still streaming: the drain goes on
        _new_request_is_refused(url)

        _ctrl_c(proc)  # the second: what is left is aborted at once
        long.join(30)  # far less than what is left of its 24 s
        assert not long.is_alive()
        assert long.finish_reason() == "abort"
        returncode = proc.wait(30)
    text = log.read_text()
    assert returncode == 0, text
    assert not re.search(r"died|dead|Traceback", text), text
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left behind: {alive}"


def test_ctrl_c_of_generate_is_one_line_and_status_130(tiny_llama: Path) -> None:
    # The CLI's own main, in a process that slows the (in-process) engine's steps first;
    # tensor parallel, so that there are worker processes to leave behind.
    code = (
        "import sys, slow_engine_steps\n"
        "from asyncengine.entrypoints.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "generate", str(tiny_llama), "hello",
         "--max-tokens", str(LONG), "--temperature", "0", "--device", "cpu", "--dtype", "float32",
         "--num-kv-blocks", "64", "--tensor-parallel-size", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_slow_env(in_core=False),
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.read(1)  # it is streaming
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 2, tree  # the two workers
        _ctrl_c(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert first and out.endswith(b"\n")  # what was streamed, its line ended
    assert proc.returncode == 130
    assert err.decode() == "asyncengine: interrupted\n"
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left behind: {alive}"
