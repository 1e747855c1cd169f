"""Shared fixtures: tiny random-weight models of real architectures, built once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncengine.testing import build_tiny_model

# Two cores: one torch thread per test process keeps timings of tiny models sane.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Ray reads it when first imported: with it, a test's Ray cluster binds 127.0.0.1 only (by
# default Ray binds the machine's interface address).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


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
