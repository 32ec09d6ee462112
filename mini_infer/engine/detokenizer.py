"""Incremental detokenization and stop strings, plus loading a model directory's tokenizer.

Each step decodes only a short window of the newest tokens; text is released once it no longer ends in
an incomplete UTF-8 sequence (a multi-byte character split across tokens), and, while stop strings are
set, the last few characters are held back because they may be the start of a stop string (which
mini_infer.engine.stop looks for).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

from mini_infer.sampling_params import SamplingParams


def load_tokenizer(model_dir: Path):
    """The directory's fast tokenizer (tokenizer.json plus tokenizer_config.json for special tokens and the
    chat template), or None when it has no tokenizer.json: such a model serves token-id prompts only.

    Parsed once per process for the same tokenizer files (Qwen's 151,646-token tokenizer.json takes ~0.7 s to parse,
    hashing the files ~20 ms): engines over models of one vocabulary and template (a bench's systems, a KL run's two
    engines, a draft and its target) share the one tokenizer object, which mini-infer only reads."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    files = [model_dir / name for name in _TOKENIZER_FILES] + sorted((model_dir / _CHAT_TEMPLATES).glob("*"))
    key = tuple((file.name, hashlib.sha256(file.read_bytes()).hexdigest()) for file in files if file.is_file())
    with _PARSED_LOCK:
        if key in _PARSED:
            _PARSED.move_to_end(key)
            return _PARSED[key]
    # The tokenizer class alone: no auto mappings, no modeling code.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    with _PARSED_LOCK:
        _PARSED[key] = tokenizer
        while len(_PARSED) > _PARSED_KEPT:
            _PARSED.popitem(last=False)
    return tokenizer


# What transformers reads for a fast tokenizer (tokenization_utils_base's file names) and its folder of named chat
# templates: the cache key is their contents.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json")
_CHAT_TEMPLATES = "additional_chat_templates"
_PARSED: OrderedDict[tuple, object] = OrderedDict()  # the most recently used last
_PARSED_KEPT = 4
_PARSED_LOCK = threading.Lock()


def raw_decoder(tokenizer):
    """The tokenizer's decode(ids, skip_special_tokens) as the Rust tokenizer runs it, without transformers' wrapper
    (its argument conversion costs ~4 us a call, twice per token per step: ~2 ms of host time a step at batch 256);
    the wrapper where it would change the text (a tokenizer that cleans up tokenization spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, decode=None) -> None:
        self.tokenizer = tokenizer
        self.decode = decode or raw_decoder(tokenizer)  # the engine's, shared by its requests
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self.stop_strings), default=0)
        self.holdback = 0 if self.include_stop else max(longest - 1, 0)
        self.output_text = ""
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already text

    def _decode(self, token_ids: list[int]) -> str:
        return self.decode(token_ids, self.skip_special_tokens)

    def update(self, token_ids: list[int], *, flush: bool = False) -> int:
        """Append the text that `token_ids` (all output ids so far) newly complete; returns its length.

        With `flush`, an incomplete trailing character is released as U+FFFD (the request is finishing).
        """
        prefix = self._decode(token_ids[self.prefix_offset: self.read_offset])
        full = self._decode(token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
            return 0
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.output_text += new_text
        return len(new_text)

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.holdback)]
