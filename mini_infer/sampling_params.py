"""SamplingParams: a request's sampling and stopping knobs (vLLM's names and meanings), validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from mini_infer.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# Far outside this range, float32 logits divided or multiplied by the penalty overflow or vanish.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_N = 128  # completions per request (OpenAI's limit for n)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's StructuredOutputsParams): exactly one of json (a JSON schema, as a dict or
    text), regex, choice (the output is one of these strings), grammar (EBNF, xgrammar's GBNF dialect) and
    json_object (any JSON object). disable_any_whitespace: JSON without whitespace between its tokens (by
    default any whitespace may come there, as in vLLM)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"must set exactly one of {', '.join(_CONSTRAINTS)}",
               given or None)
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs",
               "json must be a JSON schema (a dict or its JSON text)", self.json)
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs", "regex must be a string",
               self.regex)
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs",
               "grammar must be a string (EBNF)", self.grammar)
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs", "choice must be a non-empty list of non-empty strings", self.choice)
        _check(self.json_object in (None, True, False), "structured_outputs", "json_object must be a boolean",
               self.json_object)
        _check(isinstance(self.disable_any_whitespace, bool), "structured_outputs",
               "disable_any_whitespace must be a boolean", self.disable_any_whitespace)
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint it is: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries the whole text and token ids so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many (>= n), return the n of highest cumulative logprob, at the end
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first: None) and the top-N at its position
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before penalties and sampling
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a schema, regex, ...
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False)

    def __post_init__(self) -> None:
        _check(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
               "must be a string or a list of strings", self.stop)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               "must be a list of token ids", self.stop_token_ids)
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               "must be a dict of token id -> bias", self.logit_bias)
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value), name, "must be a finite number", value)
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]", self.n)
        _check(self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_N), "best_of",
               f"must be None or an integer in [n ({self.n}), {MAX_N}]", self.best_of)

        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and (self.top_k >= -1), "top_k",
               "must be -1 or 0 (off) or an integer >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
               "must be None or an integer in [-2**63, 2**64)", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1 (or None: up to max_model_len)", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0",
               self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})",
                   self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}] or None", value)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers", self.stop_token_ids)
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "must be non-empty strings",
               self.stop)
        for token_id, bias in (self.logit_bias or {}).items():
            _check(_is_int(token_id) and token_id >= 0, "logit_bias", "keys must be token ids (integers >= 0)",
                   token_id)
            _check(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                   f"values must be numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", bias)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams", self.structured_outputs)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind",
               self.output_kind)

    @property
    def num_samples(self) -> int:
        """How many sequences the request samples: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{name} {rule}, got {value!r}", name)
