"""Parallel sampling (SamplingParams.n > 1) the way vLLM v1 does it: a request fans out into n child requests
that share the prompt's KV blocks through the prefix cache, and their outputs come back as one RequestOutput whose
CompletionOutputs are indexed 0..n-1.

The first child runs alone until it has computed the prompt; the others join then and find every full block of the
prompt cached (reference-counted, as any shared prefix), so the prompt is prefilled once and each child recomputes
at most its last partial block before sampling its own first token. Child i samples with seed + i when the request
has a seed (vLLM's rule), so each child equals a request with that seed run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mini_infer.engine.request import Request
from mini_infer.outputs import CompletionOutput, RequestOutput
from mini_infer.sampling_params import RequestOutputKind, SamplingParams


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s: seed + index; prompt logprobs from the first child only (the others find the prompt cached);
    with best_of > n, sampled-token logprobs at least, for the cumulative logprob that ranks the children."""
    ranked = params.num_samples > params.n
    return replace(params, n=1, best_of=None, seed=params.seed + index if params.seed is not None else None,
                   prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                   logprobs=params.logprobs if params.logprobs is not None or not ranked else 0)


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    kind: RequestOutputKind
    n: int  # completions to return: all the children's, or with best_of the n of highest cumulative logprob
    keep_logprobs: bool  # the request asked for logprobs (with best_of, the children compute them regardless)
    children: list[str]  # every child's id, by index
    waiting: list[Request]  # children not yet handed to the scheduler (until the first has computed the prompt)
    latest: dict[int, CompletionOutput] = field(default_factory=dict)  # each child's last (not DELTA)
    prompt_logprobs: list | None = None  # the first child's, once it has them
    finished: set[int] = field(default_factory=set)
    num_cached_tokens: int = 0  # the first child's

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.children)

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput | None:
        """One step's outputs of this group's children as the group's output: every child's latest completion
        (CUMULATIVE), this step's completions (DELTA), or all of them once every child has finished (FINAL_ONLY);
        None when there is nothing to report."""
        for output in outputs:
            completion = output.outputs[0]
            if self.kind is not RequestOutputKind.DELTA:
                self.latest[completion.index] = completion
            if output.finished:
                self.finished.add(completion.index)
        arrived = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        self.prompt_logprobs = arrived if arrived is not None else self.prompt_logprobs
        if self.kind is RequestOutputKind.FINAL_ONLY and not self.done:
            return None
        shown = ([output.outputs[0] for output in outputs] if self.kind is RequestOutputKind.DELTA
                 else [self.latest[i] for i in sorted(self.latest)])
        if len(self.children) > self.n and self.done:  # best_of: the n likeliest, best first, indexed 0..n-1
            best = sorted(shown, key=lambda c: (-c.cumulative_logprob, c.index))[: self.n]
            shown = [replace(c, index=i, logprobs=c.logprobs if self.keep_logprobs else None)
                     for i, c in enumerate(best)]
        first = outputs[0]
        # DELTA: in the one output that brings them; else in every output from then on.
        prompt_logprobs = arrived if self.kind is RequestOutputKind.DELTA else self.prompt_logprobs
        # The prompt's cache hits are those of the first completion, which computed the prompt for the rest.
        self.num_cached_tokens = next((o.num_cached_tokens for o in outputs if o.outputs[0].index == 0),
                                      self.num_cached_tokens)
        return RequestOutput(request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             outputs=shown, finished=self.done, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=self.num_cached_tokens)
