"""`asyncengine serve --api-server-count 2 --data-parallel-size 2`: two API server processes
accept on one port, each a client of both engine cores, under a manager process. The real
`openai` client; real processes and sockets."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import psutil
import pytest
from openai_testing import BackgroundStreams, parse_metrics, parse_sse

pytestmark = pytest.mark.timeout(240)

FLAGS = [
    "--port", "0", "--served-model-name", "tiny", "--no-access-log",
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
    "--api-server-count", "2", "--data-parallel-size", "2", "--shutdown-timeout", "5",
]  # fmt: skip


@contextlib.contextmanager
def serve_group(model: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The manager on a free port; yields it and its URL once both API servers answer."""
    command = [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(model), *FLAGS]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 150
        url = None
        while url is None:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"serve did not start:\n{log.read_text()}"
            m = re.search(r"serving on ([\d.]+):(\d+)", log.read_text())
            url = f"http://{m.group(1)}:{m.group(2)}" if m else None
            time.sleep(0.05)
        while len(re.findall(r"Application startup complete", log.read_text())) < 2:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"API servers did not start:\n{log.read_text()}"
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def _group(proc: subprocess.Popen[bytes]) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(API server processes, engine-core processes) of the manager."""
    servers, cores = [], []
    for child in psutil.Process(proc.pid).children():
        cmdline = " ".join(child.cmdline())
        if "api_server_proc" in cmdline:
            servers.append(child)
        elif "engine_core_proc" in cmdline:
            cores.append(child)
    return servers, cores


async def _stream_all(url: str, n: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts: list[str] = [""] * n

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model="tiny", prompt=f"hello {i}", max_tokens=16, temperature=0, stream=True
        )
        finish = None
        async for chunk in stream:
            texts[i] += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish in ("length", "stop")

    # Separate connections, so that both API servers accept some.
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    await client.close()
    return texts


def test_two_api_servers_share_two_cores_and_drain_on_sigterm(
    chat_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serve_group(chat_model, log) as (proc, url):
        servers, cores = _group(proc)
        assert len(servers) == 2 and len(cores) == 2, (servers, cores)
        texts = anyio.run(_stream_all, url, 64)
        assert len(texts) == 64 and all(texts)

        # Each API server shares its counts every half second: poll until all are in.
        deadline = time.monotonic() + 10
        while True:
            metrics = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
            per_server = [
                metrics.get(f'asyncengine_api_server_requests_total{{api_server="{i}"}}', 0)
                for i in (0, 1)
            ]
            if sum(per_server) >= 64 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sum(per_server) >= 64 and min(per_server) > 0, per_server
        assert metrics["asyncengine_prompt_tokens_total"] > 0
        # Rank 0's series parse without their engine="0" label; rank 1's keep theirs.
        assert "asyncengine_num_requests_running" in metrics
        assert 'asyncengine_num_requests_running{engine="1"}' in metrics
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "ok" and len(health["ranks"]) == 2

        # SIGTERM while streams run: each API server drains its own, then all exit 0.
        streams = BackgroundStreams(url, 4, max_tokens=200)
        streams.started()
        everything = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        streams.join()
        results = streams.results
    _, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert len(results) == 4
    for raw in results.values():
        events = parse_sse(raw)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    # A normal start and drain says nothing at WARNING or above.
    text = log.read_text()
    assert "with 2 API server processes" in text
    assert not [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line], text


def test_a_dead_api_server_stops_the_group(chat_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve_group(chat_model, log) as (proc, _):
        servers, _ = _group(proc)
        everything = psutil.Process(proc.pid).children(recursive=True)
        servers[1].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
    _, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert "API server 1" in log.read_text()
