"""Structured outputs (SamplingParams.structured_outputs) with xgrammar, the backend vLLM uses by default.

A request's constraint is compiled into a grammar over the model's vocabulary once per distinct constraint (the
compiled grammars are cached), and the request gets its own matcher. Before a step, the engine fills one row of a
token bitmask per constrained request that samples in it (the tokens its grammar allows next); the runner applies
the batch's bitmask to the logits in one step before sampling; the engine then advances each matcher by the token
sampled. A preempted request keeps its output tokens (it is recomputed, not resampled), so its matcher stays where
it was and needs no rollback. A complete grammar allows only the model's stop tokens next, even with ignore_eos: a
request whose grammar has ended finishes. xgrammar is imported with the first constraint (it takes seconds).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from mini_infer.config import DEFAULT_MAX_JSON_WHITESPACE
from mini_infer.errors import InvalidRequestError
from mini_infer.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

MAX_CACHE_BYTES = 256 << 20  # compiled grammars kept (least recently used out first): 0.1-4 MB each, measured


class GrammarCompiler:
    """Compiles constraints into xgrammar grammars for one tokenizer and vocabulary, caching them by constraint.
    Thread-safe: a server compiles on worker threads while the engine thread builds matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int],
                 max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE) -> None:
        self._tokenizer = tokenizer
        self.max_whitespace = max_whitespace  # characters in one run of JSON whitespace (None: unbounded)
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use (reading the vocabulary takes ~1 s)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations so far (cache misses)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params` (InvalidRequestError naming structured_outputs if it cannot be)."""
        if self._tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model directory has none",
                                      "structured_outputs")
        key = _key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = self._compile(params)
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > MAX_CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        whitespace = {"any_whitespace": False} if params.disable_any_whitespace else {
            "any_whitespace": True, "max_whitespace_cnt": self.max_whitespace}
        try:
            if kind in ("json", "json_object"):
                schema = '{"type": "object"}' if kind == "json_object" else (
                    params.json if isinstance(params.json, str) else json.dumps(params.json))
                return self._compiler.compile_grammar(_json_grammar(schema, whitespace))
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":  # JSON's string escapes are the grammar's too
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for a schema, regex or grammar
            # Its first line without the "[time] file.cc:line: " of xgrammar's C++ checks.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip().split("\n")[0]) or type(e).__name__
            raise InvalidRequestError(f"structured_outputs: the {kind} constraint cannot be compiled: {reason}",
                                      "structured_outputs") from None

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar, stop_token_ids: tuple[int, ...]) -> Grammar:
        """A fresh matcher of a compiled grammar for one request; it may end on `stop_token_ids` once its grammar is
        complete (a model with none: it terminates when the grammar is complete)."""
        import xgrammar as xgr

        if stop_token_ids:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_token_ids)))
        else:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return Grammar(matcher)


class Grammar:
    """One request's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` := the tokens the grammar allows next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the mask was not applied)."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts looked at ahead of sampling)."""
        self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


# xgrammar 0.2's rule for a string of bounded length (maxLength, minLength) excludes only the quote, the backslash,
# CR and LF from its characters: a tab or another control character could come out raw, which JSON forbids. Its rule
# for other strings excludes them all; the bounded one is given the same class.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str, whitespace: dict) -> str:
    """The EBNF of a JSON schema, as xgrammar writes it, with every string character JSON allows and no other."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, **whitespace)).replace(_BOUNDED_STRING_CHARACTER,
                                                                           _JSON_STRING_CHARACTER)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab / 32)] allowing every token: bit j of word w allows token 32 w + j."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _key(params: StructuredOutputsParams) -> tuple:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    elif kind == "choice":
        value = tuple(value)
    return kind, value, params.disable_any_whitespace
