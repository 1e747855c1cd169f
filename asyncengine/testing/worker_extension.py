"""A worker extension for tests and examples of `collective_rpc`:
`worker_extension_cls="asyncengine.testing.worker_extension:InfoExtension"`.

Its methods run in every worker, with `self` the worker; each returns plain data (msgpack).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["PATH", "InfoExtension"]

PATH = "asyncengine.testing.worker_extension:InfoExtension"


class InfoExtension:
    """Worker info, an echo, and a slow call (for timeouts)."""

    rank: int
    device: Any

    def worker_info(self) -> dict[str, Any]:
        """This worker's tensor-parallel rank, device and process id."""
        return {"rank": self.rank, "device": str(self.device), "pid": os.getpid()}

    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The arguments as the worker received them."""
        return {"rank": self.rank, "args": list(args), "kwargs": kwargs}

    def slow(self, seconds: float) -> int:
        """Sleep `seconds`, then return the rank."""
        time.sleep(seconds)
        return self.rank

    def unencodable(self) -> object:
        """A result msgspec cannot encode."""
        return object()

    def record(self, folder: str) -> int:
        """Write an empty file named for this process into `folder` (so that a test sees every
        worker of every data-parallel rank that ran the call); return the pid."""
        (Path(folder) / f"pid-{os.getpid()}").touch()
        return os.getpid()

    def fail(self, message: str) -> None:
        """Raise ValueError(message) in the worker."""
        raise ValueError(message)
