"""Shared fixtures: tiny random-weight models of real architectures, built once per session.

The suite runs the same on a machine with a GPU as without one: tests of the CPU path ask for
device="cpu" (or `--device cpu`) rather than leave "auto" to the machine, and tests that need a
GPU are marked `gpu` and skip, saying so, where torch sees no CUDA device. A test that takes a
`device` argument runs on "cuda" (marked `gpu`) where there is one, else on "cpu" (Triton
kernels under its interpreter): `@triton.jit` compiles or interprets for the whole process, so
one process runs one of the two (see tests/kernels/conftest.py).

ASYNCENGINE_TEST_SIMULATE_GPU=1 checks the first half on a machine without a GPU: device "auto"
then resolves to "cuda" in this process and in every Python process a test starts (see
tests/simulate_gpu/sitecustomize.py) and `torch.cuda.is_available()` says True here, so a test
that leaves its device to the machine fails loudly; `gpu` tests are skipped, as nothing here
can run them.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path

import pytest

from asyncengine.testing import build_tiny_model

SIMULATE_GPU_ENV = "ASYNCENGINE_TEST_SIMULATE_GPU"
SIMULATE_GPU = os.environ.get(SIMULATE_GPU_ENV, "").strip() in ("1", "true", "yes")


def _simulate_gpu() -> None:
    """device "auto" resolves to "cuda" here and in every Python process started from here."""
    import importlib.util

    import torch

    folder = Path(__file__).resolve().parent / "simulate_gpu"
    # Child processes import it at start-up, as their sitecustomize; this one, which has
    # started, loads it by path.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(folder), os.environ.get("PYTHONPATH")])
    )
    spec = importlib.util.spec_from_file_location("simulate_gpu", folder / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    # As the driver does: CUDA_VISIBLE_DEVICES "" or "-1" hides the GPU.
    torch.cuda.is_available = lambda: os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


if SIMULATE_GPU:
    _simulate_gpu()

# Two cores: one torch thread per test process keeps timings of tiny models sane.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Work-pool jobs wait for their helpers (csrc/pool.c's strict mode): tests free weights right
# after their products, and a helper preempted in an item would read them after the free.
os.environ["ASYNCENGINE_POOL_STRICT"] = "1"
# Ray reads it when first imported: with it, a test's Ray cluster binds 127.0.0.1 only (by
# default Ray binds the machine's interface address).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


# Tests that download and build a peer engine (llama.cpp: minutes of silent compiling) run only
# when asked for, so that the default test command stays short.
PEERS_ENV = "ASYNCENGINE_TEST_PEERS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SIMULATE_GPU:
        gpu = pytest.mark.skip(reason=f"{SIMULATE_GPU_ENV}=1: the GPU is simulated")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(gpu)
    if os.environ.get(PEERS_ENV, "").strip() in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason=f"builds a peer engine (minutes): set {PEERS_ENV}=1 to run")
    for item in items:
        if item.get_closest_marker("peers") is not None:
            item.add_marker(skip)


# A test (with its fixtures' set-up) that runs longer than this says so on the terminal, and
# again at every such interval: a full run is never silent for a minute.
HEARTBEAT_S = 45.0


def has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames:
        return
    cuda = has_cuda()
    metafunc.parametrize("device", [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(cuda, reason="with a GPU Triton kernels run compiled, on it"),
            id="interpreter",
        ),
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda, reason="needs a CUDA device")],
            id="cuda",
        ),
    ])  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    stop = threading.Event()
    fd = _terminal_fd(item.config)
    if fd is not None:
        args = (item.nodeid, fd, stop)
        threading.Thread(target=_heartbeat, args=args, name="heartbeat", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        # The test's tensors are freed next: no native pool helper may still read them
        # (kernels/csrc/pool.c; the sanitizer run reports such a read as a use after free).
        native = sys.modules.get("asyncengine.kernels.linear_cpu")
        if native is not None:
            native.quiesce_pool()


def _terminal_fd(config: pytest.Config) -> int | None:
    """The terminal's file descriptor, which output capturing keeps aside (None if unknown).
    Written to directly, so the heartbeat never toggles capturing under a running test."""
    capman = config.pluginmanager.getplugin("capturemanager")
    out = getattr(getattr(capman, "_global_capturing", None), "out", None)
    if out is None:
        return 1  # -s: nothing is captured
    fd = getattr(out, "targetfd_save", None)
    return fd if isinstance(fd, int) else None


def _heartbeat(nodeid: str, fd: int, stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(HEARTBEAT_S):
        line = f"\n    ... still running after {time.monotonic() - started:.0f} s: {nodeid}\n"
        try:
            os.write(fd, line.encode())
        except OSError:
            return


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (once) and return the folder of a tiny model: factory(arch="llama", **overrides)."""
    cache: dict[tuple[str, tuple[tuple[str, object], ...]], Path] = {}

    def factory(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_tiny_model(path, arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


# A chat template in the tiny tokenizer's vocabulary (the tiny tokenizer is saved without one).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template."""
    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def ascii_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny Llama with a byte-level tokenizer over printable ASCII (it can spell JSON),
    smaller than the model's vocabulary (padded logits)."""
    return tiny_model_factory("llama", tokenizer="ascii")
