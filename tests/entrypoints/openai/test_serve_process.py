"""`asyncengine serve` as a real process (with its engine core in another): SIGTERM drains
the streams in flight and exits 0 within 10 s leaving no process behind; a dead engine core
gives 503s; the command's flags; the message when starlette is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai_testing import BackgroundStreams, parse_sse, serve

from asyncengine.entrypoints import cli

pytestmark = pytest.mark.timeout(180)


def engine_core(proc: subprocess.Popen[bytes]) -> psutil.Process:
    cores = [
        c
        for c in psutil.Process(proc.pid).children(recursive=True)
        if "resource_tracker" not in " ".join(c.cmdline())
    ]
    assert len(cores) == 1, cores
    return cores[0]


def assert_exits_0_and_leaves_nothing(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM; it exits 0 within 10 s (the default drain is 5 s), every descendant gone."""
    descendants = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    try:
        returncode = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit within 10 s of SIGTERM:\n{log.read_text()}")
    assert returncode == 0, log.read_text()
    _, alive = psutil.wait_procs(descendants, timeout=5)
    assert not alive, f"left behind: {alive}"


def test_sigterm_drains_streams_and_exits_0(chat_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve(chat_model, log) as (proc, url):
        streams = BackgroundStreams(url, 4, max_tokens=480)
        streams.started()
        assert_exits_0_and_leaves_nothing(proc, log)
        streams.join()
        results = streams.results
    # Each stream in flight was let finish (the default drain is 5 s): complete and well-formed.
    assert len(results) == 4
    for raw in results.values():
        events = parse_sse(raw)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1])
    assert "Finished server process" in log.read_text()


def test_dead_engine_core_gives_503_and_shutdown_still_exits_0(
    chat_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serve(chat_model, log) as (proc, url):
        engine_core(proc).kill()
        deadline = time.monotonic() + 10
        while (health := httpx.get(url + "/health", timeout=30)).status_code != 503:
            assert time.monotonic() < deadline, "/health never reported the dead engine"
            time.sleep(0.05)
        assert "dead" in health.json()["error"]["message"]
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(url + "/metrics", timeout=30).status_code == 200
        assert_exits_0_and_leaves_nothing(proc, log)


def test_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCENGINE_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "some/model"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert cli.engine_kwargs_from_args(args) == {}
    args = cli.build_parser().parse_args(
        ["serve", "m", "--api-key", "k", "--dtype", "bfloat16", "--max-num-seqs", "8",
         "--tensor-parallel-size", "2", "--port", "9000", "--shutdown-timeout", "2"]
    )  # fmt: skip
    assert (args.api_key, args.port, args.shutdown_timeout) == ("k", 9000, 2.0)
    assert cli.engine_kwargs_from_args(args) == {
        "dtype": "bfloat16", "max_num_seqs": 8, "tensor_parallel_size": 2,
    }  # fmt: skip
    monkeypatch.setenv("ASYNCENGINE_API_KEY", "from-env")
    assert cli.build_parser().parse_args(["serve", "m"]).api_key == "from-env"


def test_serve_without_starlette_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['starlette'] = None\n"
        "from asyncengine.entrypoints.cli import main\n"
        "sys.exit(main(['serve', 'some/model']))\n"
    )
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 1
    assert "pip install starlette uvicorn" in proc.stderr


def test_a_taken_port_fails_before_the_engine_loads(tiny_llama: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", str(tiny_llama),
             "--port", str(port), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    # The engine starts in the app's lifespan, which never began.
    assert "application startup" not in proc.stderr
