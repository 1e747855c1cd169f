"""Set-up shared by the processes the engine spawns (the engine core, tensor-parallel workers):
what they import, how they take signals, how they notice their parent's death, how they exit.

Only for processes the engine owns; never call these in an application's process.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

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
# client that transformers' hub utilities import; 0.05 s), and scikit-learn, which transformers'
# generation utilities import where it is installed and which imports scipy itself (without
# it in the list, a machine with scikit-learn fails every engine process's start).
_UNUSED_PACKAGES = ("scipy", "sklearn", "trio")


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

    No orphans (vLLM issue #55510's bug class). The parent holds the write end of our stdin
    (`ChildProcess`), so its death closes it: stdin reads end of file. A changed parent pid is
    the fallback check, once a second. Call it after `child_process.read_payload()`.
    """
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            readable, _, _ = select.select([sys.stdin.fileno()], [], [], 1.0)
            if readable and not os.read(sys.stdin.fileno(), 4096):
                break  # end of file: the parent is gone
        on_death()

    threading.Thread(target=watch, name=thread_name, daemon=True).start()


def install_signal_handlers(*, ignore_sigint: bool = False) -> None:
    """SIGTERM (and SIGINT, unless ignored) raise SystemExit in the main thread, so the
    process's `finally` blocks run and it shuts down cleanly.

    The engine core and tensor-parallel workers ignore SIGINT: a Ctrl-C in a terminal reaches
    the whole process group, and the engine's owner is the one to act on it (it stops the
    core, which stops its workers, in order, after a drain when serving). A child starts with
    SIGINT blocked (`child_process`); it is unblocked here, once its handling is set.
    """

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)
    if ignore_sigint:
        ignore_sigint_from_now()
    else:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def ignore_sigint_from_now() -> None:
    """Ignore SIGINT in this process (its owner acts on Ctrl-C), and unblock it: a child
    starts with SIGINT blocked (`child_process`), and a Ctrl-C held since is discarded."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# The log level of the engine's own processes (the engine core); unset, they log warnings
# and errors only, bare. `asyncengine --log-level` sets it for the processes it starts.
LOG_LEVEL_ENV = "ASYNCENGINE_LOG_LEVEL"


def setup_logging(process_name: str) -> None:
    """Log at `$ASYNCENGINE_LOG_LEVEL` (when set), each line saying which process it is from."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if not level:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"({process_name} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def hard_exit(exit_code: int) -> NoReturn:
    """Flush the logs and standard streams, then leave without the interpreter's teardown.

    The caller has shut down everything it owns; what is left is torch's and the process
    group's teardown, which takes about a second and can block on dead peers.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# Names a module of test hooks (fault injection) for the engine's processes to load, e.g.
# `asyncengine.testing.fault_injection`; the variable is inherited by every process spawned.
TEST_HOOKS_ENV = "ASYNCENGINE_TEST_HOOKS"


def load_test_hooks(table: str) -> dict[str, Callable[..., Any]]:
    """The `testing_*` functions of the test-hooks module named by `$ASYNCENGINE_TEST_HOOKS`
    (its dict attribute `table`), or none when the variable is unset: an engine in production
    never has them. The engine knows no test code; tests choose what to load."""
    module_name = os.environ.get(TEST_HOOKS_ENV)
    if not module_name:
        return {}
    hooks = dict(getattr(importlib.import_module(module_name), table))
    bad = sorted(name for name in hooks if not name.startswith("testing_"))
    if bad:
        raise ValueError(f"test hooks must be named testing_*: {bad} in {module_name}.{table}")
    return hooks
