"""What the engine hands back (vLLM's names): RequestOutput and CompletionOutput for generation, with Logprob; a
pooling model's EmbeddingRequestOutput and ScoringRequestOutput."""

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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (its replica died; stop_reason: why)
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


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ScoringOutput:
    score: float  # a reranker's relevance in (0, 1), or the cosine similarity of two embeddings


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's name): its embedding or score once its prompt is computed; `outputs`
    None only for a request aborted before that."""

    request_id: str
    outputs: EmbeddingOutput | ScoringOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


class EmbeddingRequestOutput(PoolingRequestOutput):
    """An embedding model's output: `outputs.embedding`."""

    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput):
    """A score: a reranker's for a (query, document) pair, or the cosine similarity of an embedding model's two
    embeddings: `outputs.score`."""

    __slots__ = ()
