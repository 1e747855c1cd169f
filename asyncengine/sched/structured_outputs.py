"""Structured outputs in the engine core: grammars compiled off the busy loop, one matcher per
request, and each step's token bitmask.

Pipeline: EngineCoreRequest with `structured_outputs` → `StructuredOutputManager.grammar_for`
(a compile on the grammar thread, cached by the constraint's text) → the request waits beside
the queue until its grammar is ready → `fill_bitmask` for the rows that sample this step →
`SchedulerOutput.grammar_bitmask` → the worker masks the logits → the sampled tokens advance
each matcher (`RequestGrammar.accept`).

The matcher lives with the scheduler's `Request`, whose token list it follows: a preempted
request keeps its outputs (only their KV is recomputed), so its matcher keeps its state too.

Backed by xgrammar, imported on first use: an engine that never sees a constraint never
loads it (nor the tokenizer it needs).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.sched.json_schema_grammar import (
    UnsupportedSchemaError,
    json_object_ebnf,
    json_schema_ebnf,
)

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept, most recently used first (a JSON schema's is tens of KB to a few MB).
_CACHE_ENTRIES = 256
# From this many constrained rows a step fills the bitmask on every core (below, one thread
# is cheaper than waking the others).
_BATCH_FILL_MIN_ROWS = 8
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; users need what follows.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class InvalidConstraintError(ValueError):
    """A request's constraint could not be compiled; the message names the problem."""


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """One request's constraint: its compile (shared with equal constraints), then its own
    matcher, which has accepted exactly the request's output tokens."""

    future: Future[xgrammar.CompiledGrammar]
    matcher: xgrammar.GrammarMatcher | None = None

    def is_ready(self) -> bool:
        """The compile has finished (successfully or not)."""
        return self.future.done()

    def start(self) -> None:
        """Make the matcher; InvalidConstraintError if the compile failed. Call once ready."""
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(self.future.result())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        assert self.matcher is not None
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self.matcher is not None and bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles constraints on its own thread, caches them by text, and fills bitmasks.

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's: the
    padding ids are never allowed.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_words = (vocab_size + 31) // 32  # int32 words per bitmask row
        # One thread: compiles queue behind each other, never behind the busy loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncengine-grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on the grammar thread
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the loop and by done-callbacks
        self._bitmask = np.zeros((0, self.num_words), dtype=np.int32)
        self.num_compiles = 0  # compiles started (cache misses), for statistics and tests
        self._batch_matcher: xgrammar.BatchGrammarMatcher | None = None

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A request's grammar: compiled now on the grammar thread, or taken from the cache."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._executor.submit(self._compile, *key)
                self.num_compiles += 1
                self._cache[key] = future
                future.add_done_callback(functools.partial(self._forget_failure, key))
                while len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return RequestGrammar(future)

    def _forget_failure(
        self, key: tuple[str, str], future: Future[xgrammar.CompiledGrammar]
    ) -> None:
        # A failed compile is not cached: a retry may follow a fixed cause (and costs little).
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    @staticmethod
    def wait_any(grammars: list[RequestGrammar], timeout: float) -> None:
        """Block until one of `grammars` is ready, or `timeout` seconds pass."""
        wait_futures([g.future for g in grammars], timeout=timeout, return_when="FIRST_COMPLETED")

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """The allowed next tokens of each grammar, as int32 [R, W] rows (bit t % 32 of word
        t // 32 set: token t allowed), R = len(grammars), W = `num_words`."""
        rows = len(grammars)
        if self._bitmask.shape[0] < rows:
            self._bitmask = np.zeros(
                (max(rows, 2 * self._bitmask.shape[0]), self.num_words), np.int32
            )
        bitmask = self._bitmask[:rows]
        matchers = []
        for grammar in grammars:
            assert grammar.matcher is not None
            matchers.append(grammar.matcher)
        if rows < _BATCH_FILL_MIN_ROWS:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        else:
            # The rows on every core at once: the model's threads are idle between steps.
            if self._batch_matcher is None:
                import xgrammar

                self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=_num_cores())
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask.tobytes()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- on the grammar thread -----------------------------------------------------------

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        compiler = self._compiler or self._make_compiler()
        try:
            # JSON: compact (no free whitespace for a model to wander in), and strict where
            # xgrammar's own conversion is loose (json_schema_grammar.py).
            if kind == "json":
                return compiler.compile_grammar(json_schema_ebnf(text))
            if kind == "json_object":
                return compiler.compile_grammar(json_object_ebnf())
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(_json_loads_list(text)))
            assert kind == "grammar", kind
            return compiler.compile_grammar(text)
        # xgrammar reports every parse error as RuntimeError; ours name an unsupported
        # schema feature.
        except (RuntimeError, UnsupportedSchemaError) as exc:
            message = _NATIVE_PREFIX.sub("", str(exc)).strip()
            raise InvalidConstraintError(
                f"structured_outputs.{kind} could not be compiled: {message}"
            ) from None

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar
        from transformers import AutoTokenizer

        from asyncengine.gguf.serving import tokenizer_folder

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(self.model_dir))
        stop = list(self.eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
        )
        # xgrammar takes special tokens (`<pad>`, `<|im_start|>`) for their text, so a JSON
        # string could hold one; the detokenizer then drops it (skip_special_tokens) and the
        # output no longer fits its schema. An empty token is one xgrammar never allows.
        special = set(tokenizer.all_special_ids) - set(stop)
        if special:
            vocab = list(info.decoded_vocab)
            for token_id in special:
                if 0 <= token_id < len(vocab):
                    vocab[token_id] = b""
            info = xgrammar.TokenizerInfo(
                vocab,
                xgrammar.VocabType.RAW,
                vocab_size=info.vocab_size,
                stop_token_ids=stop,
                add_prefix_space=info.add_prefix_space,
            )
        # Our own cache holds compiled grammars (by text, shared futures); xgrammar's would
        # hold a second copy.
        threads = max(1, min(4, (os.cpu_count() or 1) - 1))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        return self._compiler


def _num_cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return max(1, cores or os.cpu_count() or 1)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    # JSON string escapes (\", \\, \n, \uXXXX) are valid EBNF string-literal escapes.
    import json

    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _json_loads_list(text: str) -> list[str]:
    import json

    value = json.loads(text)
    assert isinstance(value, list)
    return [str(v) for v in value]
