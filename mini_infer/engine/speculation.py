"""Speculative decoding's bookkeeping on the scheduler's side: how many drafts a request verifies next (DraftPolicy),
what a draft costs (DraftCost), and the counts vLLM reports of it (SpecDecodeStats).
docs/decisions/024-speculative-decoding.md.

The adaptive rule: a request's drafts are accepted one after another, each (as far as we know) with the same chance
a, estimated from its own verify steps (each draft examined is a trial: those accepted, and the first rejected one).
The i-th draft then brings a^i tokens on average and costs c of a request's share of a step: its row in the verify step
and its share of the proposer's time, both measured engine-wide (DraftCost). The row's price depends on the batch: at
one request a decode step is a read of the weights and a row is nearly free; in a batch of 16 the rows' compute is
much of the step, and a request's extra row costs a good part of its share of it. So the steps' time (less the
proposer's) is fitted over their rows, and a row priced at the fit's slope over a request's share of a step of the
running batch (VERIFY_ROW_COST before the steps vary in rows). The proposer's share, before its first measurement,
is the draft model's weights over the target's, a decode step being a read of the weights. So a request proposes the
drafts with a^i >= c, up to num_speculative_tokens: a draft model a third of its target's size (0.5B for 1.5B)
proposes fewer than one a fifteenth of it (0.5B for 7B), and a batch of 16 fewer than a single request. A new
request's estimate starts at PRIOR_ACCEPTANCE, an even chance (it started at certainty before, and at alpha 0 those
first steps' drafts were most of what adaptive k cost). One whose estimate falls so low that it proposes none probes
with a single draft after 4 steps without drafts, then after 8, 16, ... 64 while the probes keep failing; an accepted
draft resets that wait.
Those waits are for a draft costing PROBE_COST of a step; a dearer one waits as many times longer, so that probing
costs about the same share of a request's steps whatever the draft (at most PROBE_COST / FIRST_PROBE_WAIT, 3 %).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mini_infer.speculative_config import VERIFY_ROW_COST

EMA_WEIGHT = 0.5  # of a new sample in the running estimates (two or three steps dominate them)
PRIOR_ACCEPTANCE = 0.5
FIRST_PROBE_WAIT = 4
LONGEST_PROBE_WAIT = 64
PROBE_COST = 0.125  # the draft cost the waits above are for (a dearer draft waits cost / PROBE_COST times as long)
ROW_WINDOW = 32  # the decode steps a verify row's price is fitted over


@dataclass(slots=True)
class DraftCost:
    """A draft's cost in a request's share of a step: its verify row, and the proposer's time for one draft of
    every proposing request (a draft model's step over them) over the rest of the step (`proposer`, a running
    estimate from the steps that proposed: Scheduler.update). Per proposing request, not per request of the step:
    a batch's drafts share the draft model's steps as its tokens share the target's, so where all propose, a
    request's share of the proposer over its share of the step is that ratio; a request probing alone in a batch of
    4 pays a whole draft step for itself, and counted against a quarter of the step it read 4x dearer, which shut a
    batch out of drafting for good after a run of failed drafts.

    The row: the recent decode steps' time less the proposer's, fitted as fixed + slope x rows (least squares over
    the last ROW_WINDOW steps whose requests all decoded or verified, none prefilling), priced for a batch of n
    requests at slope x n / (fixed + slope x n): one more row's time over a request's share of an n-row step."""

    proposer: float  # start: the prior (the draft model's decode weights over the target's; 0 for n-gram lookup)
    steps: deque = field(default_factory=lambda: deque(maxlen=ROW_WINDOW))  # (rows, seconds less the proposer's)

    def value(self, batch: int) -> float:
        """A draft's cost for a request of a batch of `batch` requests."""
        return self.row(batch) + self.proposer

    def row(self, batch: int) -> float:
        """A verify row's time over a request's share of a decode step of `batch` rows (VERIFY_ROW_COST while the
        steps held are too few or all of one size)."""
        if len(self.steps) < 3:
            return VERIFY_ROW_COST
        mean_rows = sum(rows for rows, _ in self.steps) / len(self.steps)
        mean_seconds = sum(seconds for _, seconds in self.steps) / len(self.steps)
        spread = sum((rows - mean_rows) ** 2 for rows, _ in self.steps)
        if spread == 0:
            return VERIFY_ROW_COST
        slope = max(0.0, sum((rows - mean_rows) * (seconds - mean_seconds) for rows, seconds in self.steps) / spread)
        fixed = max(0.0, mean_seconds - slope * mean_rows)
        step = fixed + slope * batch
        return slope * batch / step if step > 0 else VERIFY_ROW_COST

    def observe(self, step_seconds: float, proposer_seconds: float, drafts: int, proposing: int, rows: int) -> None:
        """A step that took `step_seconds`, `proposer_seconds` of them proposing `drafts` drafts for the next, for
        `proposing` requests (drafts / proposing draft steps, each over all of them); `rows`: its tokens where all
        its requests decoded or verified (0 for a step with prompt tokens, which the row's fit leaves out)."""
        rest = step_seconds - proposer_seconds
        if rest <= 0:
            return
        if rows:
            self.steps.append((rows, rest))
        if drafts > 0 and proposing > 0:
            sample = proposer_seconds / (drafts / proposing) / rest
            self.proposer += EMA_WEIGHT * (sample - self.proposer)


@dataclass(slots=True)
class DraftPolicy:
    """One request's number of drafts per step."""

    max_k: int
    adaptive: bool = True
    acceptance: float = PRIOR_ACCEPTANCE  # the estimate of a draft's chance of acceptance
    idle: int = 0  # steps without drafts since drafts stopped or the last probe
    wait: int = FIRST_PROBE_WAIT  # the steps without drafts before the next probe (at a draft cost of PROBE_COST)

    def next_k(self, cost: float) -> int:
        """The drafts to propose for the request's next step (called once for each step it samples in), a draft
        costing `cost` of its share of a step (DraftCost.value)."""
        if not self.adaptive:
            return self.max_k
        k = 0
        while k < self.max_k and self.acceptance ** (k + 1) >= cost:
            k += 1
        if k:
            return k
        if self.idle < self.wait * max(1.0, cost / PROBE_COST):
            self.idle += 1
            return 0
        self.idle, self.wait = 0, min(2 * self.wait, LONGEST_PROBE_WAIT)
        return 1

    def observe(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of its `proposed` drafts kept."""
        if not proposed:
            return
        trials = accepted + (accepted < proposed)
        self.acceptance += EMA_WEIGHT * (accepted / trials - self.acceptance)
        if accepted:
            self.idle, self.wait = 0, FIRST_PROBE_WAIT


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals (vLLM's spec_decode counters): verify steps with drafts, draft tokens verified, of those
    accepted, tokens emitted by verify steps (accepted + one each), and accepted drafts by position (0: the first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = [a + b for a, b in zip(self.accepted_per_position + [0] * width,
                                              other.accepted_per_position + [0] * width)][:width]
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens,
                               self.num_emitted_tokens + other.num_emitted_tokens, per_position)

    def __radd__(self, other: int | SpecDecodeStats) -> SpecDecodeStats:
        """sum() over replicas' stats starts from 0."""
        return self + SpecDecodeStats() if other == 0 else other + self

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
