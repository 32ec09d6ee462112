"""What the engine hands back: RequestOutput and CompletionOutput (vLLM's names), and Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float | None  # None only for an echoed prompt's first token (nothing before it to score it)
    rank: int | None  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: the sampled token plus the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) its logprob and the top-N at its
    # position, once the whole prompt is computed (in the first output that carries it, for DELTA).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when the request was first scheduled
