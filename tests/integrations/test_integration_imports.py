"""What each integration needs installed, and the names users import from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def test_the_aiohttp_integration_needs_no_starlette() -> None:
    # Starlette comes with the `serve` extra; an aiohttp app need not install it. The SSE
    # framing both integrations share (entrypoints/sse.py) imports no web framework.
    code = (
        "import sys\n"
        "sys.modules['starlette'] = None  # an import of it raises ImportError\n"
        "import asyncengine.integrations.aiohttp\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_the_starlette_integration_keeps_its_names() -> None:
    from starlette.responses import Response

    from asyncengine.entrypoints.sse_response import SSEResponse as Defined
    from asyncengine.integrations.starlette import SSEResponse, stream_generation

    assert SSEResponse is Defined
    assert issubclass(SSEResponse, Response)  # FastAPI passes a Response through as it is
    assert callable(stream_generation)
