"""SpeculativeConfig: vLLM's `speculative_config`, validated once (docs/decisions/024-speculative-decoding.md).

{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} proposes the tokens
that followed the latest earlier occurrence of a request's last n..m tokens in its own prompt and output;
{"model": PATH, "num_speculative_tokens": k} proposes with a draft model (a directory or a GGUF file) of the same
vocabulary (its own KV tensors over the target's blocks; "quantization" int8 or int4 quantises it at load). `adaptive`
(on by default; mini-infer's own key) lets each request's number of drafts follow its recent acceptance, down to none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

METHODS = ("ngram", "draft_model")
# vLLM's n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# A draft's row in a verify step, relative to a request's share of a decode step, until the steps measure it
# (engine/speculation.py DraftCost fits it; on the AMX Xeon a 1.5B bf16 target's 5-row step cost 1.01 steps at one
# request, its 7-row one 1.20, the 7B int8 target's 5-row one 1.33).
VERIFY_ROW_COST = 0.05


@dataclass(slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str | None = None  # ngram or draft_model; None: draft_model when `model` is given
    model: str | None = None  # the draft model's directory (draft_model)
    quantization: str | None = None  # the draft's weights: None (its checkpoint's), int8 or int4
    prompt_lookup_max: int | None = None  # ngram: the longest suffix looked up
    prompt_lookup_min: int | None = None  # ngram: the shortest
    adaptive: bool = True
    draft_tensor_parallel_size: int = 1

    @classmethod
    def from_value(cls, raw: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A config from the dict a user gives (unknown keys refused by name), or as it is."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens is required (the drafts verified a step)")
        return cls(**raw)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)} (or give a draft "
                             f"'model'), got {self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError("speculative_config.draft_tensor_parallel_size must be 1 (the draft runs whole on rank "
                             f"0), got {self.draft_tensor_parallel_size!r}")
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft()

    def _check_ngram(self) -> None:
        if self.model is not None or self.quantization is not None:
            raise ValueError("speculative_config: method 'ngram' proposes from the request's own tokens; it takes no "
                             "'model' or 'quantization'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = low if low is not None else high, high if high is not None else low
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def _check_draft(self) -> None:
        if self.model is None:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's directory)")
        if not Path(self.model).is_dir() and not (str(self.model).endswith(".gguf") and Path(self.model).is_file()):
            raise FileNotFoundError(f"speculative_config.model: draft model directory (or GGUF file) not found: "
                                    f"{self.model}")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max are the ngram method's; a draft model takes "
                             "neither")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"speculative_config.quantization must be None, 'int8' or 'int4' (the draft's weights, "
                             f"quantised at load), got {self.quantization!r}")
