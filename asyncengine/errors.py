"""Errors that reach users of the engine."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone: every open stream and every later call raises this."""


class EngineStartupError(RuntimeError):
    """The engine core failed to start; the message carries the root cause."""


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be served by asyncengine."""
