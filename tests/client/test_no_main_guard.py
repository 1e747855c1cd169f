"""Applications need no `if __name__ == "__main__":` guard: the engine core and the
tensor-parallel workers start in fresh interpreters that never import the application's
`__main__`. Each test writes a user's program as it would be written, without the guard, runs
it in a real interpreter, and checks that it generated and left no process behind."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)

_ASYNC_BODY = """
import os
from asyncengine import AsyncLLM, SamplingParams

async def main():
    async with AsyncLLM.from_pretrained({model!r}, device="cpu", dtype="float32", max_model_len=256,
                                        num_kv_blocks=64) as engine:
        print("core pid", engine._core_client.proc.pid, flush=True)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        async for out in engine.generate("hello world", params):
            pass
        print("generated", len(out.outputs[0].token_ids), flush=True)
"""

ASYNCIO_PROGRAM = _ASYNC_BODY + "\nimport asyncio\nasyncio.run(main())\n"
TRIO_PROGRAM = _ASYNC_BODY + "\nimport trio\ntrio.run(main)\n"

TP_PROGRAM = """
import os
from asyncengine import LLM, SamplingParams

llm = LLM({model!r}, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
print("core pid", os.getpid(), flush=True)
outs = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
print("generated", len(outs[0].outputs[0].token_ids), flush=True)
llm.shutdown()
"""

APP_MODULE = """
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncengine import AsyncLLM, SamplingParams
from asyncengine.integrations.starlette import stream_generation

engine = AsyncLLM.from_pretrained({model!r}, device="cpu", dtype="float32", max_model_len=256,
                                  num_kv_blocks=64)


async def generate(request: Request) -> Response:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return await stream_generation(engine, "hello world", params)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with engine:
        yield


app = Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)
"""


def _run(
    args: list[str], cwd: Path, stdin: str | None = None, env: dict[str, str] | None = None
) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "generated 4" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def _assert_engine_processes_gone(stdout: str) -> None:
    """The engine's own process (and so its children) exited with the program."""
    pid = int(re.search(r"core pid (\d+)", stdout).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("program", [ASYNCIO_PROGRAM, TRIO_PROGRAM], ids=["asyncio", "trio"])
def test_a_plain_script(program: str, tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(program.format(model=str(tiny_llama)))
    _assert_engine_processes_gone(_run([str(script)], tmp_path))


def test_python_dash_c(tiny_llama: Path, tmp_path: Path) -> None:
    _assert_engine_processes_gone(
        _run(["-c", ASYNCIO_PROGRAM.format(model=str(tiny_llama))], tmp_path)
    )


def test_a_script_piped_on_stdin(tiny_llama: Path, tmp_path: Path) -> None:
    program = TRIO_PROGRAM.format(model=str(tiny_llama))
    _assert_engine_processes_gone(_run(["-"], tmp_path, stdin=program))


def test_offline_tensor_parallel_in_a_plain_script(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "offline.py"
    script.write_text(TP_PROGRAM.format(model=str(tiny_llama)))
    # The program's processes inherit this mark; tests running beside this one (xdist) start
    # workers of their own, which must not count.
    mark = str(tmp_path)
    _run([str(script)], tmp_path, env={**os.environ, "AE_TEST_PROGRAM": mark})
    # No worker outlives the program (the workers are the only python children it had).
    time.sleep(0.5)
    left = []
    for p in psutil.process_iter(["cmdline"]):
        if "asyncengine.executor.worker_proc" not in (p.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get("AE_TEST_PROGRAM") == mark:
                left.append(p)
    assert not left


def test_a_uvicorn_app_module(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "service.py").write_text(textwrap.dedent(APP_MODULE).format(model=str(tiny_llama)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=30)
                break
            except httpx.TransportError:
                assert server.poll() is None, server.stdout.read().decode()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the app did not start"
                time.sleep(0.2)
        assert response.status_code == 200
        assert response.text.rstrip().endswith("data: [DONE]")
        children = psutil.Process(server.pid).children(recursive=True)
        assert children, "the engine core runs in a child process of the server"
    finally:
        server.terminate()
        server.wait(30)
        server.stdout.close()  # type: ignore[union-attr]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
