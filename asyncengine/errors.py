"""Errors that reach users of the engine, and how a failure is described across a process."""

from __future__ import annotations

import os
import traceback


class EngineDeadError(RuntimeError):
    """The engine core is gone: every open stream and every later call raises this."""


class EngineStartupError(RuntimeError):
    """The engine core failed to start; the message carries the root cause."""


class EngineGenerateError(RuntimeError):
    """One request failed while it was processed (e.g. its detokenisation raised); its stream
    ends with this error, naming the request and the cause. The engine goes on."""


class InvalidRequestError(EngineGenerateError, ValueError):
    """The engine core found a request invalid where only it could tell (e.g. a structured
    outputs constraint that does not compile): a `ValueError` for its sender, raised by its
    stream. The engine goes on."""


class EngineOverloadedError(RuntimeError):
    """`max_queued_requests` requests already wait: this one is refused, at once. Retry later
    (the server answers 503 with Retry-After)."""


class EngineDrainingError(RuntimeError):
    """The engine is draining (`AsyncLLM.drain()`): it takes no new requests until closed."""


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be served by asyncengine."""


def describe_exception(exc: BaseException) -> str:
    """One line for a log or a wire message: the error, its root cause, and where the root
    cause was raised (file:line in function). Used where an exception cannot travel itself,
    e.g. from the engine core's process to the client."""
    root = exc
    while root.__cause__ is not None or (
        root.__context__ is not None and not root.__suppress_context__
    ):
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    text = f"{type(exc).__name__}: {exc}"
    if root is not exc:
        text += f" (root cause: {type(root).__name__}: {root})"
    frames = traceback.extract_tb(root.__traceback__)
    if frames:
        last = frames[-1]
        text += f" [at {os.path.basename(last.filename)}:{last.lineno} in {last.name}]"
    return text
