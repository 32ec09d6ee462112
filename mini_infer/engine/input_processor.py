"""InputProcessor: a request's prompt tokenized, every input checked and its structured-output grammar compiled
before anything of it runs (a ProcessedRequest). A pooling model's request (PoolingParams) gets the model's
defaults filled in and is checked against what the model allows (its task, hidden size, matryoshka dimensions).

An engine uses it in add_request, a data-parallel router before picking a replica, and the async engine on a worker
thread (so a long prompt or a new grammar never holds the engine's thread up): a bad request fails at once, in the
caller, with an InvalidRequestError naming the field and its allowed range.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mini_infer.config import EngineConfig
from mini_infer.engine.structured_output import GrammarCompiler
from mini_infer.errors import InvalidRequestError
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Prompt forms: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts (with both keys the
# ids are the prompt and the text is kept for the outputs).
PromptType = str | list[int] | dict


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A request ready for an engine: its prompt's text (None for token ids) and ids, its sampling parameters (the
    model's defaults where none were given; a pooling model's request: its PoolingParams), the tokens it may
    generate (0 for pooling), and its structured-output grammar compiled (None without a constraint)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams | PoolingParams
    max_tokens: int
    grammar: xgr.CompiledGrammar | None = None

_GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
                           "min_new_tokens": "min_tokens"}


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, num_kv_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_kv_blocks = num_kv_blocks
        self.generation_config = _read_generation_config(Path(config.model))
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(tokenizer, config.model_config.vocab_size, self.eos_token_ids,
                                        config.structured_outputs_max_whitespace)

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.model_config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling defaults of the model's generation_config.json, as vLLM does."""
        overrides = {ours: self.generation_config[theirs] for theirs, ours in _GENERATION_CONFIG_KEYS.items()
                     if self.generation_config.get(theirs) is not None}
        return SamplingParams(**overrides)

    def process(self, prompt: PromptType, params: SamplingParams | PoolingParams | None) -> ProcessedRequest:
        """The request checked, its prompt tokenized and its grammar compiled (cached: once per distinct
        constraint); params None takes the model's defaults (a pooling model's: PoolingParams())."""
        task = self.config.task
        if params is None:
            params = PoolingParams() if task != "generate" else self.default_sampling_params()
        if isinstance(params, PoolingParams):
            params = self._pooling_params(params)
            text, token_ids = self._tokenize(prompt, special_tokens=True)
            return ProcessedRequest(text, token_ids, params, self._check_pooling_length(len(token_ids)))
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams or a PoolingParams, got "
                                      f"{type(params).__name__}", "params")
        if task != "generate":
            what = "embeddings (LLM.embed, /v1/embeddings)" if task == "embed" else "scores (LLM.score, /v1/rerank)"
            raise InvalidRequestError(f"{self.config.model} runs task {task}: it computes {what}, not text; "
                                      "SamplingParams need a generating model", "params")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError("SamplingParams.stop needs a tokenizer; this model directory has none", "stop")
        check_token_ids(params.logit_bias or (), self.config.model_config.vocab_size, "logit_bias token id",
                        "logit_bias")
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
        text, token_ids = self._tokenize(prompt)
        return ProcessedRequest(text, token_ids, params, self._check_lengths(len(token_ids), params), grammar)

    @functools.cached_property
    def _max_prompt_chars(self) -> int:
        """More characters than this never fit max_model_len tokens: no token spells more than the longest
        vocabulary entry, and normalisation at most doubles a text (a generous bound)."""
        longest = max(map(len, self.tokenizer.get_vocab()))
        return 2 * longest * self.config.max_model_len

    def _pooling_params(self, params: PoolingParams) -> PoolingParams:
        """A pooling request's parameters checked against the model (InvalidRequestError naming the field), the
        model's default normalize filled in for an embedding."""
        task, mc = self.config.task, self.config.model_config
        if task == "generate":
            raise InvalidRequestError(f"{self.config.model} runs task generate: PoolingParams (embeddings, scores) "
                                      "need an embedding model or a reranker (task embed or score)", "params")
        if task == "score":
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(f"{name} is for embeddings; a reranker's score takes none", name)
            return params
        dims = params.dimensions
        if dims is not None:
            if dims > mc.hidden_size:
                raise InvalidRequestError(f"dimensions must be <= {mc.hidden_size} (the model's hidden size), got "
                                          f"{dims}", "dimensions")
            if mc.matryoshka_dimensions is not None and dims not in mc.matryoshka_dimensions:
                raise InvalidRequestError(f"dimensions must be one of {list(mc.matryoshka_dimensions)} (the model's "
                                          f"matryoshka_dimensions), got {dims}", "dimensions")
            if mc.matryoshka_dimensions is None and not mc.is_matryoshka:
                raise InvalidRequestError("dimensions: this model's embeddings cannot be cut short (its config.json "
                                          "has neither is_matryoshka nor matryoshka_dimensions: it was not trained "
                                          "for it)", "dimensions")
        normalize = self.config.pooler.normalize if params.normalize is None else params.normalize
        return replace(params, normalize=normalize)

    def _check_pooling_length(self, num_prompt_tokens: int) -> int:
        """A pooling request's prompt fits the model and the cache (its whole length: it generates nothing); the
        tokens it may generate, 0."""
        if num_prompt_tokens > self.config.max_model_len:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens, more than max_model_len "
                                      f"({self.config.max_model_len})", "prompt")
        blocks = -(-num_prompt_tokens // self.config.block_size)
        if blocks > self.num_kv_blocks:
            raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) needs {blocks} KV blocks but the whole "
                                      f"cache has {self.num_kv_blocks} (block_size {self.config.block_size})", "prompt")
        return 0

    def _tokenize(self, prompt: PromptType, special_tokens: bool = False) -> tuple[str | None, list[int]]:
        """The prompt's text and ids; texts tokenized with the tokenizer's special tokens where `special_tokens` (a
        pooling model's, as vLLM's and sentence-transformers' embeddings are: Qwen3-Embedding's tokenizer appends
        the <|endoftext|> its last-token pooling reads)."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a dict prompt needs a 'prompt' or a 'prompt_token_ids' key", "prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"text prompts need a tokenizer and {self.config.model} has no "
                                          "tokenizer.json; pass token ids instead", "prompt")
            check_text(prompt, "prompt")
            if len(prompt) > self.config.max_model_len and len(prompt) > self._max_prompt_chars:
                raise InvalidRequestError(f"prompt has {len(prompt)} characters, more than max_model_len "
                                          f"({self.config.max_model_len}) tokens can ever hold", "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=special_tokens)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string, a list of token ids or a dict, got "
                                      f"{type(prompt).__name__}", "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty: it must have at least one token", "prompt")
        vocab = self.config.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        check_token_ids(token_ids, vocab, "prompt token id", "prompt")
        return text, token_ids

    def _check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        max_len = self.config.max_model_len
        if num_prompt_tokens >= max_len:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_len}, which "
                                      "leaves no room to generate (prompt length must be < max_model_len)", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - num_prompt_tokens
        if num_prompt_tokens + max_tokens > max_len:
            raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                                      f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_len})",
                                      "max_tokens")
        block_size = self.config.block_size
        blocks = -(-(num_prompt_tokens + max_tokens) // block_size)
        if blocks > self.num_kv_blocks:
            raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                                      f"{blocks} KV blocks but the whole cache has {self.num_kv_blocks} "
                                      f"(block_size {block_size})", "max_tokens")
        count = params.num_samples
        if count > 1:
            # A group is preempted and brought back whole (engine/scheduler.py), so its completions must fit the
            # cache together at their longest, sharing the prompt's cached blocks (all but the last token's).
            shared = (num_prompt_tokens - 1) // block_size if self.config.enable_prefix_caching else 0
            together = shared + count * (blocks - shared)
            if together > self.num_kv_blocks:
                field = "best_of" if count > params.n else "n"
                raise InvalidRequestError(f"{count} completions ({field}) of a prompt of {num_prompt_tokens} tokens + "
                                          f"max_tokens ({max_tokens}) need {together} KV blocks together but the "
                                          f"whole cache has {self.num_kv_blocks} (block_size {block_size}); they are "
                                          "scheduled and preempted as one group", field)
        return max_tokens


def check_token_ids(token_ids, vocab_size: int, what: str, field: str) -> None:
    """Refuse the first id outside the vocabulary, naming `field` (InvalidRequestError)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{what} {bad} is out of range: token ids must be in [0, {vocab_size - 1}]", field)


def check_text(text: str, field: str) -> None:
    """Refuse a string that is not Unicode text (a lone surrogate, which JSON's \\ud800 escapes can carry): the
    tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{field} is not valid Unicode text: {e.reason} at character {e.start} "
                                  f"({text[e.start:e.end]!a})", field) from None


def _read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
