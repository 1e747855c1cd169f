"""Test hooks that slow every engine step down, so that a test can act while a tiny model's
stream is still in flight (a drain that lasts, a Ctrl-C mid-stream).

Imported in the engine core by naming it in `$ASYNCENGINE_TEST_HOOKS` (with this folder on
PYTHONPATH: the core inherits both), or imported first by a process that runs the engine
itself. Each step sleeps `$SLOW_ENGINE_STEP_S` seconds (default 0.05) before it runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

from asyncengine.core.engine_core import EngineCore

STEP_S = float(os.environ.get("SLOW_ENGINE_STEP_S", "0.05"))

_step = EngineCore.step


def _slow_step(self: EngineCore) -> Any:
    time.sleep(STEP_S)
    return _step(self)


EngineCore.step = _slow_step  # type: ignore[method-assign]

# What `$ASYNCENGINE_TEST_HOOKS` loads, in the core and in workers: no methods of their own.
CORE_HOOKS: dict[str, Any] = {}
WORKER_HOOKS: dict[str, Any] = {}
