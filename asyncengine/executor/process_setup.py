"""Set-up shared by the processes the engine spawns (the engine core, tensor-parallel workers)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable

from asyncengine.config import ModelConfig


def skip_triton_unless_used(model_config: ModelConfig) -> None:
    """Keep this process from importing triton when its attention backend is torch.

    torch's compiler stack imports triton whenever it is installed (transformers imports that
    stack), which costs about 70 MB of resident memory and some start-up time in a process
    that never launches a Triton kernel. Only for processes the engine owns: call it before
    torch is imported. An ImportError for triton is what torch sees without it installed.
    """
    if model_config.attention_backend != "triton" and "triton" not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment]


# Packages that torch's and transformers' imports pull in whenever they are installed, that an
# engine-owned process never uses, and that asyncengine does not depend on (so a process without
# them is a configuration the engine supports anyway): scipy (transformers' object-detection
# losses; 0.15 s of start-up and 37 MB), trio (an optional backend of httpcore2, the HTTP
# client that transformers' hub utilities import; 0.05 s).
_UNUSED_PACKAGES = ("scipy", "trio")


def skip_unused_packages(model_config: ModelConfig) -> None:
    """Keep this process from importing packages it never uses: triton unless it runs the
    Triton kernels (see skip_triton_unless_used), and `_UNUSED_PACKAGES`.

    For them the process looks like an install without them (ImportError; transformers'
    availability checks answer False). Only for processes the engine owns, before torch and
    transformers are imported; a package already imported (by the application's main module,
    which a spawned process imports first) is left as it is.
    """
    skip_triton_unless_used(model_config)
    for name in _UNUSED_PACKAGES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]


def start_parent_watch(on_death: Callable[[], None], thread_name: str) -> None:
    """Call `on_death` (in a daemon thread) once this process's parent has died.

    No orphans (vLLM issue #55510's bug class): the parent's sentinel (a pipe from
    multiprocessing's spawn) closes when it dies; a changed parent pid is the fallback check.
    """
    parent = multiprocessing.parent_process()
    parent_pid = os.getppid()

    def watch() -> None:
        sentinel = parent.sentinel if parent is not None else None
        while True:
            if sentinel is not None:
                if multiprocessing.connection.wait([sentinel], timeout=1.0):
                    break
            else:
                time.sleep(1.0)
            if os.getppid() != parent_pid:
                break
        on_death()

    threading.Thread(target=watch, name=thread_name, daemon=True).start()
