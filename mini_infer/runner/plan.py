"""StepPlan: what the scheduler tells the model runners each step, as plain data (the same small message goes to
every rank). A request's data travels once, when it enters the batch; after that a step carries only what
changed: the tokens each request gained since it last ran, its new KV blocks, and who left the batch.

Speculative decoding (docs/decisions/024): a request that verifies draft tokens computes 1 + k tokens, its last
sampled token and its k drafts (spec_token_ids), and samples at each of those positions; the positions of drafts the
target rejected are not computed after all, and the blocks past its tokens go back: the next plan that schedules it
says so (computed_tokens, kept_blocks), so every rank's batch agrees with the scheduler again."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams


# The id a pending token (engine Request.num_pending) stands under in a plan's tokens and the runners' batch until its
# step's sample replaces it on the device (ModelRunner._fill_pending); never a vocabulary id.
PLACEHOLDER = -1


@dataclass(slots=True)
class NewRequest:
    """A request entering the batch (admitted, or re-admitted after preemption with its outputs so far)."""

    request_id: str
    slot: int  # its row in the persistent batch (the KV manager's row of the request)
    token_ids: list[int]  # prompt, then any output tokens it already has
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are cached already (a cached prefix)
    block_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: a pooling model's request (runner/pooler.py)
    min_tokens_stop_ids: tuple[int, ...]  # ids the sampler masks until min_tokens outputs exist


@dataclass(slots=True)
class GrammarBitmask:
    """The tokens structured-output requests may sample this step: `bitmask` int32 [sampled rows, ceil(vocab / 32)]
    (bit j of word w allows token 32 w + j), one row per request that samples, in batch order; `rows` are the
    rows that constrain anything."""

    rows: list[int]
    bitmask: torch.Tensor


@dataclass(slots=True)
class StepPlan:
    """One step. `request_ids` is the batch order: requests decoding one token first, then prompt chunks."""

    is_prefill: bool = False  # a prompt (or part of one) is computed in this step
    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per request
    # The requests whose step computes their last token (and any drafts they verify), in batch order: those that
    # sample (or pool) in it. Where a token is pending (Request.num_pending: sampled by the step before, not yet
    # known on the host) the request's tokens carry PLACEHOLDER, which rank 0 replaces on the device.
    emitting: list[str] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # Requests already in the batch that gained tokens (their sampled ones) or blocks since they last ran.
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests that left the batch since the last plan: their slots are free again. A finished request's
    # sampling state goes too; a preempted one keeps its seeded generator for when it comes back.
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    grammar: GrammarBitmask | None = None  # when a structured-output request samples in this step
    # Speculative decoding: the draft tokens each verifying request computes after its last token (num_new_tokens
    # counts them); how many drafts rank 0 proposes, after this step, for each request that samples in it (a
    # proposal is made only where asked); and, for requests whose batch rows ran ahead of the scheduler (a verify
    # step's rejected positions, their blocks returned), their computed tokens and blocks as they are now.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    propose: dict[str, int] = field(default_factory=dict)
    computed_tokens: dict[str, int] = field(default_factory=dict)
    kept_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)
