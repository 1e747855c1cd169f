"""The one error a GGUF file that can't be served raises."""

from __future__ import annotations

import os


class GGUFError(ValueError):
    """A GGUF file that is corrupt, truncated or not servable; the message names the file."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{os.fspath(path)}: {problem}")
        self.path = os.fspath(path)
        self.problem = problem
