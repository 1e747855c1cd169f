"""RequestStream: the hand-off between the output handler and one `generate()` iterator.

The output handler puts each RequestOutput as it is made; the iterator takes them. A stream
holds at most one undelivered output, so a slow consumer never makes it grow: a newer
CUMULATIVE output replaces the older one (it contains it), and DELTA outputs merge into one.
"""

from __future__ import annotations

import anyio

from asyncengine.errors import EngineDeadError, EngineGenerateError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import RequestOutputKind


class RequestStream:
    """One request's outputs, for a single consumer task. `put*` are for the event loop's
    thread only (the output handler), `get` for the request's iterator."""

    def __init__(self, request_id: str, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.finished = False  # the final output has been put
        self._pending: RequestOutput | None = None
        self._error: str | None = None  # EngineDeadError's message, once the engine is gone
        self._failure: EngineGenerateError | None = None  # this request alone failed
        self._event = anyio.Event()

    def put(self, output: RequestOutput) -> None:
        pending = self._pending
        if pending is None:
            self._pending = output
        elif self.output_kind == RequestOutputKind.DELTA:
            _merge_delta(pending, output)
        else:
            self._pending = output  # CUMULATIVE: the newer output contains the older one
        self.finished = output.finished
        self._event.set()

    def put_dead(self, message: str) -> None:
        """The engine is gone: `get` raises EngineDeadError(message) after what is pending."""
        if self._error is None:
            self._error = message
            self._event.set()

    def put_failure(self, error: EngineGenerateError) -> None:
        """This request failed: `get` raises `error` (what is pending is dropped: the request's
        outputs cannot be trusted past the failure)."""
        self._pending = None
        self._failure = error
        self.finished = True
        self._event.set()

    async def get(self) -> RequestOutput:
        """The next output; EngineGenerateError if the request failed, EngineDeadError once
        the engine is gone."""
        while self._pending is None and self._error is None and self._failure is None:
            await self._event.wait()
            self._event = anyio.Event()
        if self._failure is not None:
            raise self._failure
        output = self._pending
        if output is None:
            raise EngineDeadError(self._error)
        self._pending = None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a newer DELTA output into an undelivered one, sequence by sequence."""
    by_index: dict[int, CompletionOutput] = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = c
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.metrics = new.metrics
