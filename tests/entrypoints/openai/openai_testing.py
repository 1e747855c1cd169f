"""Helpers for the server tests: a uvicorn server in a thread, SSE and /metrics parsing."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from starlette.applications import Starlette

from asyncengine.entrypoints.openai import server_state
from asyncengine.entrypoints.openai.server import Server, make_server
from asyncengine.entrypoints.openai.state import ServerState

API_KEY = "sk-test-key"
MODEL_NAME = "tiny-chat"
MAX_BODY = 64 * 1024
# max_model_len 512 leaves room for long streams (the disconnect tests); 512 blocks of 16
# tokens hold 64 concurrent streams many times over. On the CPU on any machine.
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=512, seed=0
)


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    server: Server
    state: ServerState

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


@contextlib.contextmanager
def run_in_thread(
    app: Starlette, drain_timeout: float = 1.0, start_timeout: float = 120.0
) -> Iterator[RunningServer]:
    """Serve `app` on a free port of 127.0.0.1 from a thread (its own asyncio loop)."""
    server = make_server(
        app,
        port=0,
        log_config=None,
        log_level="warning",
        access_log=False,
        drain_timeout=drain_timeout,
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start (see the log)")
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", server, server_state(app))
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


def parse_sse(raw: str) -> list[Any]:
    """The events of a complete SSE body: JSON objects, then the string "[DONE]" last.

    Asserts the framing: every event is one `data: ` line followed by a blank line.
    """
    assert raw.endswith("\n\n"), f"unterminated stream: {raw[-200:]!r}"
    events: list[Any] = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"bad event {block!r}"
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", "the stream must end with data: [DONE]"
    assert "[DONE]" not in events[:-1]
    return events


_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value}, with the model_name label left out, and
    rank 0's `engine="0"` (the only rank without data parallel).

    Asserts the format: HELP and TYPE before each family, one sample per line.
    """
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m is not None, f"bad sample line {line!r}"
        name, labels, value = m.groups()
        assert any(name == t or name.startswith(t + "_") for t in typed), f"untyped {name}"
        kept = [
            lb
            for lb in (labels or "").split(",")
            if lb and not lb.startswith("model_name=") and lb != 'engine="0"'
        ]
        key = f"{name}{{{','.join(kept)}}}" if kept else name
        samples[key] = float(value)
    return samples


SERVE_FLAGS = [
    "--port", "0", "--served-model-name", "tiny", "--no-access-log", "--device", "cpu",
    "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "512",
]  # fmt: skip


@contextlib.contextmanager
def serve(model: Path, log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`asyncengine serve` on a free port; yields the process and its URL once healthy."""
    command = [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(model)]
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, *SERVE_FLAGS, *flags], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"serve did not start:\n{log.read_text()}"
            m = re.search(r"Uvicorn running on (http://[\d.:]+)", log.read_text())
            url = m.group(1) if m else None
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        yield proc, url
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


class BackgroundStreams:
    """`n` streamed /v1/completions requests, each in a thread; `started()` waits until every
    one has received something, `join()` waits for their ends; `results[i]` is stream i's raw
    body."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.results: dict[int, str] = {}
        self._streaming = [threading.Event() for _ in range(n)]
        self._threads = [
            threading.Thread(target=self._stream, args=(url, i, max_tokens)) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _stream(self, url: str, i: int, max_tokens: int) -> None:
        body = {"prompt": f"hi {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            chunks = []
            for chunk in r.iter_text():
                chunks.append(chunk)
                self._streaming[i].set()
            self.results[i] = "".join(chunks)

    def started(self, timeout: float = 60) -> None:
        for event in self._streaming:
            assert event.wait(timeout), "a stream never started"

    def join(self, timeout: float = 30) -> None:
        for t in self._threads:
            t.join(timeout)
