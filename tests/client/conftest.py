"""Fixtures for the async client: module-scoped backends so one engine serves a module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    # Module scope, so a module-scoped async fixture (one engine per module) can share it.
    return str(request.param)
