"""Request: one prompt's state as it flows through scheduler, runner and detokenizer (a pooling model's request:
through scheduler and runner only, its PoolingParams in place of SamplingParams)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mini_infer.engine.detokenizer import IncrementalDetokenizer
from mini_infer.engine.speculation import DraftPolicy
from mini_infer.engine.structured_output import Grammar
from mini_infer.outputs import Logprob
from mini_infer.pooling_params import PoolingParams
from mini_infer.runner.plan import PLACEHOLDER
from mini_infer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    max_tokens: int  # params.max_tokens, or what max_model_len leaves when that is None (a pooling request: 0)
    eos_token_ids: frozenset[int]  # empty when params.ignore_eos
    detokenizer: IncrementalDetokenizer | None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or scheduled to be: Scheduler.schedule)
    # Tokens sampled by scheduled steps whose results are not in yet (1 between a step's schedule() and its update();
    # 2 while the next step runs ahead of it: engine/llm_engine.py). They count among num_tokens as placeholders.
    num_pending: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams.prompt_logprobs, by position
    prompt_logprobs_emitted: bool = False
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    index: int = 0  # which of its group's n completions (SamplingParams.n; engine/group.py)
    group_id: str | None = None  # the request it was fanned out of, or None
    grammar: Grammar | None = None  # SamplingParams.structured_outputs: where its output is in its grammar
    # Every prompt position computed, none taken from the prefix cache: prompt logprobs (cached positions would have
    # none) and mean pooling (the mean reads every position's hidden state).
    whole_prompt: bool = False
    # Speculative decoding: the drafts proposed for its next step, and how many it proposes (engine/speculation.py).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_policy: DraftPolicy | None = None
    # What the last RequestOutput already carried (for DELTA outputs).
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0

    def __post_init__(self) -> None:
        if self.pooling:
            return
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.whole_prompt = True

    @property
    def pooling(self) -> bool:
        """A pooling model's request: its prompt is computed, then it finishes with its embedding or score."""
        return isinstance(self.params, PoolingParams)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (O(end - start), not O(num_tokens)); a pending
        token's position holds PLACEHOLDER."""
        num_prompt, num_known = len(self.prompt_token_ids), len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > num_known:
            return self.token_ids_slice(start, num_known) + [PLACEHOLDER] * (end - max(start, num_known))
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt: end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token ids that end the request (once it has min_tokens outputs); none for a pooling request."""
        return () if self.pooling else (*self.eos_token_ids, *self.params.stop_token_ids)

    @property
    def text(self) -> str:
        return self.detokenizer.visible_text(self.status.finished) if self.detokenizer else ""

    @property
    def finished(self) -> bool:
        return self.status.finished
