"""SamplingParams: how one request's tokens are chosen and when it stops.

It crosses the socket inside `EngineCoreRequest`, so it is a `msgspec.Struct`. The client
validates it: at construction, and again when a request is submitted (it may have been changed
since). The engine core and the workers decode the same fields as `CoreSamplingParams`, the
base class without the checks: msgspec runs `__post_init__` on every decode, and a request
that was validated once need not be validated again in every process it passes through.
"""

from __future__ import annotations

import enum
import json as _json
from collections.abc import Iterable
from typing import Any

import msgspec

_MAX_LOGPROBS = 20
# Counts and token ids are int32 in the engine's tensors: larger values are refused here,
# with the field named, rather than overflowing somewhere in the core.
_MAX_INT32 = 2**31 - 1
# Stop strings are matched against every new piece of text: bound how much matching a
# request can ask for.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192
MAX_STOP_TOKEN_IDS = 1024
# A constraint is compiled in the engine core: bound what one request can ask it to compile.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 4096
# A prompt's output budget when its SamplingParams leave max_tokens unset (vLLM's and
# OpenAI's completions default); a chat's is what the context leaves.
DEFAULT_MAX_TOKENS = 16
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a stream carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


def _bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}={value!r} is invalid: {allowed}")


def _bad_constraint(field: str, value: object, allowed: str) -> ValueError:
    shown = value if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
    return ValueError(f"StructuredOutputsParams.{field}={shown!r} is invalid: {allowed}")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on what a request may generate; exactly one kind per request.

    - `json`: a JSON schema (a dict, or its JSON text); the output is a JSON value valid
      against it.
    - `json_object=True`: any JSON object.
    - `regex`: the whole output matches the regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar (GBNF style, `root ::= ...`); the output derives from `root`.

    The client checks the shape here (ValueError naming the field); the engine core compiles
    the constraint, and a constraint it cannot compile fails its request alone with a
    ValueError naming the problem.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `STRUCTURED_OUTPUT_KINDS`."""
        for name in STRUCTURED_OUTPUT_KINDS:
            if name != "json_object" and getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, text): equal keys compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else _json.loads(str(self.json))
            # Not sorted: the order of a schema's properties is the order of the output's keys.
            return kind, _json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))

    def validate(self) -> None:
        """ValueError naming the invalid field and what is allowed."""
        given = [
            name
            for name in STRUCTURED_OUTPUT_KINDS
            if (getattr(self, name) is not None if name != "json_object" else self.json_object)
        ]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                f"; got {', '.join(given) if given else 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise _bad_constraint("json_object", self.json_object, "must be True or False")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            self._validate_schema(value)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise _bad_constraint(kind, value, "must be a non-empty string")
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise _bad_constraint(
                    kind, f"<{len(value)} chars>", f"at most {MAX_CONSTRAINT_CHARS} characters"
                )
        elif kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise _bad_constraint(kind, value, "must be a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES or sum(map(len, value)) > MAX_CONSTRAINT_CHARS:
                raise _bad_constraint(
                    kind,
                    f"<{len(value)} choices>",
                    f"at most {MAX_CHOICES} choices of {MAX_CONSTRAINT_CHARS} characters in all",
                )

    @staticmethod
    def _validate_schema(value: object) -> None:
        if isinstance(value, str):
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise _bad_constraint(
                    "json", f"<{len(value)} chars>", f"at most {MAX_CONSTRAINT_CHARS} characters"
                )
            try:
                value = _json.loads(value)
            except ValueError as exc:
                raise _bad_constraint("json", value, f"not valid JSON: {exc}") from None
        elif isinstance(value, dict):
            try:
                text = _json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise _bad_constraint("json", value, f"not JSON-serialisable: {exc}") from None
            if len(text) > MAX_CONSTRAINT_CHARS:
                raise _bad_constraint(
                    "json", f"<{len(text)} chars>", f"at most {MAX_CONSTRAINT_CHARS} characters"
                )
        if not isinstance(value, dict):
            raise _bad_constraint(
                "json", value, "must be a JSON schema: a dict, or a string holding a JSON object"
            )


class CoreSamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The sampling settings as the engine core and the workers hold them: the fields of a
    `SamplingParams` that the client has validated, trusted as they are."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    # UNSET: the API's default (DEFAULT_MAX_TOKENS for a prompt, up to max_model_len for a
    # chat, as OpenAI's two endpoints do); None: up to max_model_len. The client resolves
    # UNSET before the request reaches the core.
    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    min_tokens: int = 0
    stop: str | list[str] | None = None  # a string becomes a one-item list
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (each given what precedes it) and of the
    # top-N alternatives at each prompt position, as vLLM's; None: not computed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None


class SamplingParams(CoreSamplingParams, omit_defaults=True, kw_only=True):
    """Per-request sampling settings, vLLM's names and meanings.

    Invalid values raise `ValueError` naming the field and the allowed range, at construction
    and again when the request is submitted (`validate()`).
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first invalid field and its allowed range (a `stop` string
        becomes a one-item list)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= _MAX_INT32:
            raise _bad("n", self.n, "must be an integer >= 1")
        if not is_num(self.temperature) or not self.temperature >= 0.0:
            raise _bad("temperature", self.temperature, "must be a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or not -1 <= self.top_k <= _MAX_INT32:
            raise _bad(
                "top_k",
                self.top_k,
                f"must be an integer in [1, {_MAX_INT32}], or 0 / -1 to disable",
            )
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise _bad("seed", self.seed, "must be None or an integer in [0, 2**63)")
        max_tokens = self.max_tokens
        if max_tokens is not None and max_tokens is not msgspec.UNSET:
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                max_tokens_ok = False
            else:
                max_tokens_ok = 1 <= max_tokens <= _MAX_INT32
            if not max_tokens_ok:
                raise _bad(
                    "max_tokens", max_tokens, f"must be None or an integer in [1, {_MAX_INT32}]"
                )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= _MAX_INT32:
            raise _bad("min_tokens", self.min_tokens, f"must be an integer in [0, {_MAX_INT32}]")
        if isinstance(max_tokens, int) and self.min_tokens > max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise _bad("stop", self.stop, "must be a non-empty string or a list of them")
        if self.stop is not None and (
            len(self.stop) > MAX_STOP_STRINGS or sum(map(len, self.stop)) > MAX_STOP_CHARS
        ):
            raise _bad(
                "stop",
                f"<{len(self.stop)} strings>",
                f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all",
            )
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
            or not all(is_int(t) and 0 <= t <= _MAX_INT32 for t in self.stop_token_ids)
        ):
            raise _bad(
                "stop_token_ids",
                self.stop_token_ids[:8] if isinstance(self.stop_token_ids, list) else "?",
                f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {_MAX_INT32}]",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, value, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= _MAX_LOGPROBS
        ):
            raise _bad(
                "logprobs", self.logprobs, f"must be None or an integer in [0, {_MAX_LOGPROBS}]"
            )
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS
        ):
            raise _bad(
                "prompt_logprobs",
                self.prompt_logprobs,
                f"must be None or an integer in [0, {_MAX_LOGPROBS}]",
            )
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise _bad(
                "output_kind", self.output_kind, "must be CUMULATIVE, DELTA or FINAL_ONLY"
            ) from None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise _bad(
                    "structured_outputs",
                    self.structured_outputs,
                    "must be None or a StructuredOutputsParams",
                )
            self.structured_outputs.validate()


def default_sampling_params(defaults: Iterable[tuple[str, float | int]]) -> SamplingParams:
    """A SamplingParams holding a model's sampling defaults (`ModelConfig.sampling_defaults`,
    from its generation_config.json); SamplingParams' own defaults for the fields they leave
    out."""
    return SamplingParams(**dict(defaults))  # type: ignore[arg-type]
