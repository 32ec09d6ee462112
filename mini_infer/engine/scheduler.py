"""Scheduler: the waiting and running queues, admission, preemption; what each step computes, and what follows it.

`schedule()` is one token-budget loop (vLLM v1's shape): running requests first, decode tokens ahead of the prompt
chunks still being prefilled, then waiting requests in arrival order, each taking what the budget
(max_num_batched_tokens) and the free blocks allow. A newly admitted request first takes over the KV blocks of its
longest cached prompt prefix (KVCacheManager.match_prefix), so it starts with those tokens computed; it is admitted
only while one block per running request stays free (so the next decode step need not preempt what was admitted).
Without chunked prefill a prompt is admitted only whole. A request samples in the step that computes its last token.
With a step-time target (EngineConfig.target_itl_ms) and requests decoding, a prompt chunk is cut to what a cost
model of this machine's steps (engine.step_cost, learnt from the steps' measured times) predicts keeps the step
within the target: stall-free batching as Sarathi-Serve's, with the budget still the upper bound.

When a running request finds no free block, the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (from its cached prefix, if its blocks are still cached by then). A completion of a
request of n > 1 goes with its running siblings (taken out of the step if they were in it already): the group comes
back whole, and its prompt's blocks, which the siblings share, are freed rather than kept for one of them. No new
request is admitted in a step that had to preempt (re-admitting a victim at once would only thrash).

A plan's tokens count as computed when it goes out, and each token a request samples in it as pending (a placeholder
among its tokens): with async scheduling the next step is planned before this one's update (`schedule(run_ahead)`:
it preempts nothing and leaves out requests whose pending token is their last). `update(plan, sampled)` owns what
follows the step: the pending tokens replaced by the sampled ones (a verify step's rejected positions uncounted),
prefix-cache registration of the blocks it filled, the stop checks (stop tokens, max_tokens, stop strings, a finished
structured-output grammar) and retiring finished requests, whose blocks return at once. A pooling model's request
(embeddings, scores) is prefill only: the step that computes its prompt's last token gives its value (PoolerOutput),
and it finishes there.

Each step's decision goes out as a StepPlan (plain data): a request's tokens, blocks and sampling parameters once,
when it enters the runners' batch, then only what it gained since it last ran, and who left the batch; with the
structured-output bitmask of the constrained requests that sample in it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mini_infer.config import DEFAULT_CHUNKED_BUDGET, EngineConfig
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.engine.speculation import DraftCost, DraftPolicy, SpecDecodeStats
from mini_infer.engine.step_cost import StepCost, StepShape
from mini_infer.engine.stop import check_stop
from mini_infer.engine.structured_output import allocate_bitmask
from mini_infer.runner.plan import GrammarBitmask, NewRequest, StepPlan
from mini_infer.runner.pooler import PoolerOutput
from mini_infer.runner.sampler import SamplerOutput
from mini_infer.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


# The fewest prompt tokens a decoding step takes while a prompt waits, however long the cost model predicts the step
# to run: one KV block of the default size; prompts advance even when the decodes alone fill the step-time target.
MIN_PROMPT_CHUNK = 16


def _engine_default(name: str):
    return EngineConfig.__dataclass_fields__[name].default


@dataclass(slots=True)
class StepUpdate:
    """What a step changed, for the engine's outputs: each request that sampled a token (in the plan's order) with
    the token and its logprobs (None unless asked), the prompt logprobs the step computed, each pooling request
    whose prompt it finished with its embedding or score, and the requests it finished (already retired)."""

    sampled: list[tuple[Request, int, tuple | None]] = field(default_factory=list)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    pooled: list[tuple[Request, list[float] | float]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int = _engine_default("max_num_seqs"),
                 max_num_batched_tokens: int = DEFAULT_CHUNKED_BUDGET,
                 enable_chunked_prefill: bool = _engine_default("enable_chunked_prefill"),
                 vocab_size: int | None = None, step_cost: StepCost | None = None,
                 target_step_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
                 speculative: SpeculativeConfig | None = None, max_model_len: int | None = None,
                 draft_cost_prior: float = 0.0) -> None:
        if (step_cost is None) != (target_step_s is None):
            raise ValueError("a step-time target needs a step cost model, and a model a target")
        if step_cost is not None and not enable_chunked_prefill:
            raise ValueError("a step-time target needs chunked prefill (it sizes the prompt chunks)")
        self.kv_cache = kv_cache
        self.step_cost = step_cost  # with target_step_s: prompt chunks sized to keep decoding steps within it
        self.target_step_s = target_step_s
        self._clock = clock
        self._timed: StepShape | None = None  # the last step's shape, while its time is being measured
        self._timed_at = 0.0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.vocab_size = vocab_size  # the width of the structured-output bitmask
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._num_constrained = 0  # unfinished requests with a structured-output grammar
        self._num_penalised = 0  # unfinished requests with repetition, frequency or presence penalties
        # What the runners' batch holds of each request in it, as last sent.
        self._sent: dict[str, _Sent] = {}
        # Speculative decoding: its config, and the longest a request may grow (a draft model's lookahead stays within)
        if speculative is not None and max_model_len is None:
            raise ValueError("speculative decoding needs the scheduler's max_model_len (it bounds the lookahead)")
        self.speculative = speculative
        self.max_model_len = max_model_len
        self.spec_stats = SpecDecodeStats()
        # A draft's cost (its proposer's prior: EngineConfig.draft_cost_prior), learnt from the steps; the last
        # step's (start, proposer seconds, drafts, proposing requests, decode rows) until the next schedule() times it.
        self.draft_cost = DraftCost(draft_cost_prior)
        self._draft_price = 0.0  # DraftCost.value for this step's batch
        self._spec_step: tuple[float, float, int, int, int] | None = None
        self._scheduled_at = 0.0
        self._left: list[str] = []  # finished since the last plan
        self._preempted: list[str] = []  # preempted while this plan is made

    def add(self, request: Request) -> None:
        spec = self.speculative
        if spec is not None and not request.pooling:
            request.draft_policy = DraftPolicy(spec.num_speculative_tokens, spec.adaptive)
        if request.grammar is not None:
            if self.vocab_size is None:
                raise ValueError("a structured-output request needs the scheduler's vocab_size (its bitmask width)")
            self._num_constrained += 1
        if _penalised(request):
            self._num_penalised += 1
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the running one's tokens are known (its sampled tokens then
        pending): not where a step needs the tokens before it on the host, which a structured-output grammar (its
        bitmask), penalties (the tokens seen) and speculative decoding (the drafts) do."""
        return not (self._num_constrained or self._num_penalised or self.speculative is not None)

    # ---- the step ----

    def schedule(self, run_ahead: bool = False) -> StepPlan:
        """The next step. run_ahead: a step is still running (its requests' sampled tokens pending); this one never
        preempts (a request it has no blocks for waits for a step) and leaves out the requests whose pending token is
        their last."""
        now = self._clock()
        if self._timed is not None:  # the last step ran from its schedule() to this one
            self.step_cost.observe(self._timed, now - self._timed_at)
            self._timed = None
        if self._spec_step is not None:
            started, *work = self._spec_step
            self.draft_cost.observe(now - started, *work)
            self._spec_step = None
        if self.speculative is not None:
            self._draft_price = self.draft_cost.value(len(self.running))
        self._scheduled_at = now
        plan = StepPlan()
        shape = StepShape()
        budget = self.max_num_batched_tokens
        preempted_before = len(self._preempted)
        # Decode tokens ahead of prompt chunks (a stable sort keeps admission order within each).
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            # (one preempted in this loop, as a victim or a victim's sibling, is waiting again)
            if budget <= 0 or request.status is not RequestStatus.RUNNING or (
                    request.num_pending and request.num_output_tokens + request.num_pending >= request.max_tokens):
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 1:
                num_new = self._chunk_limit(shape, request.num_computed_tokens, num_new)
                if not num_new:
                    continue
            drafts = self._drafts(request, budget) if num_new == 1 and request.spec_token_ids else []
            num_new += len(drafts)
            samples = request.num_computed_tokens + num_new == request.num_tokens + len(drafts)
            if self._grow_or_preempt(request, num_new, plan, preempt=not run_ahead):
                self._plan_add(plan, request, num_new, drafts, self._drafts_to_propose(request, num_new, samples))
                shape.add(num_new, request.num_computed_tokens, request.num_prompt_tokens)
                budget -= num_new
        budget = self.max_num_batched_tokens - plan.num_tokens  # a preempted group's planned tokens come back
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(self._preempted) == preempted_before):
            num_new, propose = self._admit(self.waiting[0], budget, shape)
            if not num_new:
                break
            request = self.running[-1]
            self._plan_add(plan, request, num_new, [], propose)
            shape.add(num_new, request.num_computed_tokens, request.num_prompt_tokens)
            budget -= num_new
        requests = {r.request_id: r for r in self.running}
        self._order(plan, requests)
        if self.step_cost is not None and plan.request_ids:
            # (a preemption took requests back out of the plan after they were counted: count the plan again)
            self._timed = shape if len(self._preempted) == preempted_before else self._shape(plan, requests)
            self._timed_at = now
        self._commit(plan, requests)
        if self._num_constrained:
            plan.grammar = self._grammar_bitmask(plan, requests)
        plan.finished_ids, self._left = self._left, []
        plan.preempted_ids, self._preempted = self._preempted, []
        return plan

    def update(self, plan: StepPlan, sampled: SamplerOutput | PoolerOutput | None) -> StepUpdate:
        """Account for a step the runners computed: the blocks its tokens filled, registered in the prefix cache;
        for the requests that sampled, the token in place of the pending one, the stop checks, and retiring the
        finished (a request finished or aborted since the plan was made is skipped); a pooling request whose prompt
        is computed takes its value and is retired."""
        generated = isinstance(sampled, SamplerOutput)
        update = StepUpdate(prompt_logprobs=sampled.prompt_logprobs or {} if generated else {})
        rows = iter(zip(sampled.token_ids, sampled.logprobs)) if generated else iter(())
        values = iter(sampled.values) if isinstance(sampled, PoolerOutput) else iter(())
        emitted = iter(sampled.num_emitted or ()) if generated else iter(())
        proposals = iter(sampled.draft_token_ids or ()) if generated else iter(())
        proposing = drafted = 0
        decode_only = True  # every request of the step decoded or verified (the rows DraftCost prices)
        requests = {request.request_id: request for request in self.running}
        emitting = set(plan.emitting)
        for request_id, num_new in zip(plan.request_ids, plan.num_new_tokens):
            request = requests.get(request_id)
            num_drafts = len(plan.spec_token_ids.get(request_id, ()))
            if request_id not in emitting:  # a prompt chunk with more to come: nothing sampled
                if request is not None:
                    self._cache_blocks(request)
                continue
            if request is None:  # finished or aborted while the step ran (the next was scheduled ahead of this update)
                if generated:
                    for _ in range(next(emitted, 1)):
                        next(rows)
                    next(proposals, None)
                else:
                    next(values)
                continue
            decode_only &= num_new == num_drafts + 1 and request.num_output_tokens > 0
            if request.pooling:
                self._cache_blocks(request)
                update.pooled.append((request, next(values)))
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                update.finished.append(request)
                continue
            request.num_pending -= 1
            count = next(emitted, 1)  # the request's last token and its accepted drafts are computed, no more
            for _ in range(count):
                token_id, logprobs = next(rows)
                if request.finished:  # (a stop among the accepted drafts: the rest are dropped)
                    continue
                request.output_token_ids.append(token_id)
                check_stop(request, token_id, request.grammar is not None and _advance_grammar(request, token_id))
                update.sampled.append((request, token_id, logprobs))
            if num_drafts:
                # (schedule() counted the drafts' positions computed: a rejected one's is not after all, nor one
                # past a stop)
                request.num_computed_tokens = min(request.num_computed_tokens - num_drafts + count - 1,
                                                  request.num_tokens)
                self.spec_stats.record(num_drafts, count - 1)
                request.draft_policy.observe(num_drafts, count - 1)
            # (after the tokens are appended: a block registers the tokens it holds; none past a stop)
            self._cache_blocks(request)
            if self.speculative is not None:
                request.spec_token_ids = next(proposals, [])
                proposing += bool(request.spec_token_ids)
                drafted += len(request.spec_token_ids)
            if request.finished:
                self.finish(request, request.status)
                update.finished.append(request)
            elif (self.speculative is not None  # (only drafts' slots run past a request's tokens)
                  and self.kv_cache.num_blocks_owned(request_id) > self.kv_cache.blocks_for(request.num_tokens)):
                sent = self._sent[request_id]
                sent.blocks, sent.trimmed = min(sent.blocks, self.kv_cache.trim(request_id, request.num_tokens)), True
        # (A request resuming after steps without drafts first catches its draft model up on every token since:
        # that is counted in, the price of resuming; docs/decisions/024.)
        if self.speculative is not None and generated and self.has_unfinished():
            self._spec_step = (self._scheduled_at, sampled.draft_seconds, drafted, proposing,
                              plan.num_tokens if decode_only else 0)
        return update

    def _cache_blocks(self, request: Request) -> None:
        """Register the request's blocks full of computed tokens in the prefix cache (none holding a pending token:
        its id is not known yet; a step scheduled ahead may still be computing the last of them, and every later step
        reads them after it)."""
        self.kv_cache.cache_blocks(request.request_id, request.token_ids_slice,
                                   min(request.num_computed_tokens, request.num_tokens - request.num_pending))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a running or waiting request and return its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.grammar is not None:
            self._num_constrained -= 1
        if _penalised(request):
            self._num_penalised -= 1
        self.kv_cache.free(request.request_id)
        self._sent.pop(request.request_id, None)
        self._left.append(request.request_id)
        if not self.has_unfinished():
            self._timed = self._spec_step = None  # the engine may idle before the next step: no step time to learn

    # ---- the step-time target ----

    def _chunk_limit(self, shape: StepShape, num_computed: int, num_new: int) -> int:
        """How many of a prompt chunk's `num_new` tokens (after `num_computed`) the step takes: all of them unless
        requests decode in it and the cost model predicts the step would then run past the target (or cannot predict
        yet); then the most that keeps it within, but at least MIN_PROMPT_CHUNK for the step's first chunk (so
        prompts always advance), and none for a later chunk that does not fit."""
        if self.step_cost is None or not shape.decodes:
            return num_new
        predict, target = self.step_cost.predict, self.target_step_s
        seconds = predict(shape.with_chunk(num_new, num_computed))
        if seconds is None:  # a model that has seen too few steps: the smallest chunk, which teaches it the most
            return 0 if shape.prompt_tokens else min(MIN_PROMPT_CHUNK, num_new)
        if seconds <= target:
            return num_new
        fits, over = 0, num_new  # the predicted time grows with the chunk: bisect for the largest that fits
        while over - fits > 1:
            mid = (fits + over) // 2
            if predict(shape.with_chunk(mid, num_computed)) <= target:
                fits = mid
            else:
                over = mid
        return fits if shape.prompt_tokens else max(fits, min(MIN_PROMPT_CHUNK, num_new))

    def _shape(self, plan: StepPlan, requests: dict[str, Request]) -> StepShape:
        """The shape of the step as planned (after any preemption took requests back out)."""
        shape = StepShape()
        for rid, num_new in zip(plan.request_ids, plan.num_new_tokens):
            request = requests[rid]
            shape.add(num_new, request.num_computed_tokens, request.num_prompt_tokens)
        return shape

    # ---- admission and preemption ----

    # ---- speculative decoding ----

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The proposed drafts a decoding request verifies this step: as many as the token budget and its max_tokens
        leave room for (with the token after them), up to the first its grammar would not take."""
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        drafts = request.spec_token_ids[: max(room, 0)]
        if request.grammar is not None and drafts:
            valid = 0
            while valid < len(drafts) and request.grammar.accept(drafts[valid]):
                valid += 1
            if valid:
                request.grammar.rollback(valid)
            drafts = drafts[:valid]
        return drafts

    def _proposal(self, request: Request, samples: bool) -> int:
        """How many drafts rank 0 proposes after this step for a request (its policy's number, within what its
        max_tokens leaves after this step's token and the next's); 0 where it does not sample in the step."""
        if request.draft_policy is None or not samples:
            return 0
        room = request.max_tokens - request.num_output_tokens - 2
        return min(request.draft_policy.next_k(self._draft_price), room) if room > 0 else 0

    def _drafts_to_propose(self, request: Request, num_new: int, samples: bool, reserve: int = 0) -> int:
        """_proposal's number, where a draft model's lookahead slots fit in the free blocks beyond `reserve`; none
        where they do not (they never preempt a request nor hold back an admission)."""
        lookahead = self._lookahead(request, num_new, samples)
        if lookahead:
            kv, end = self.kv_cache, request.num_computed_tokens + num_new + lookahead
            needed = kv.blocks_for(end) - kv.num_blocks_owned(request.request_id)
            if needed > kv.num_free_blocks - reserve or not kv.allocate_slots(request.request_id, end):
                return 0
        return self._proposal(request, samples)

    def _lookahead(self, request: Request, num_new: int, samples: bool) -> int:
        """Slots past this step's tokens where a draft model's proposals after it write their own K/V (as many as
        it may propose, within max_model_len); none for the ngram method or a request that does not sample."""
        if request.draft_policy is None or not samples or self.speculative.method != "draft_model":
            return 0
        return max(0, min(request.draft_policy.max_k, self.max_model_len - request.num_computed_tokens - num_new))

    # ---- admission and preemption ----

    def _admit(self, request: Request, budget: int, shape: StepShape) -> tuple[int, int]:
        """Admit the first waiting request with its cached prefix and up to `budget` more tokens (all of them
        without chunked prefill; fewer where the step-time target says so); the tokens scheduled, 0 when it cannot
        be admitted now, and the drafts to propose after the step. It leaves one block per running request free,
        and where it computes its whole prompt, the one its first decode needs too (a generating request's)."""
        # Prompt logprobs and mean pooling compute the whole prompt (Request.whole_prompt), as vLLM.
        hits = [] if request.whole_prompt else self.kv_cache.match_prefix(request.all_token_ids)
        cached = len(hits) * self.kv_cache.block_size
        remaining = request.num_tokens - cached
        num_new = min(remaining, budget)
        if num_new > 1:
            num_new = self._chunk_limit(shape, cached, num_new)
        if num_new < 1 or (not self.enable_chunked_prefill and num_new < remaining):
            return 0, 0
        blocks = self.kv_cache.blocks_for
        decodes = num_new == remaining and not request.pooling  # (a pooling request ends with its prompt)
        extra = blocks(request.num_tokens + 1) - blocks(request.num_tokens) if decodes else 0
        if not self.kv_cache.allocate_with_prefix(request.request_id, hits, cached + num_new,
                                                  len(self.running) + extra):
            return 0, 0
        self.kv_cache.count_prefix_query(request.num_tokens, cached)
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = cached
        if request.num_cached_tokens is None:  # (a recompute after preemption is not the client's cache hit)
            request.num_cached_tokens = cached
        propose = self._drafts_to_propose(request, num_new, decodes, len(self.running) + extra)
        self.running.append(request)
        return num_new, propose

    def _grow_or_preempt(self, request: Request, num_slots: int, plan: StepPlan, preempt: bool = True) -> bool:
        """Slots for the request's next `num_slots` tokens, preempting the most recently admitted running requests
        (each with its group) until there are; False when the request itself had to go (or, without `preempt`, when
        there are none: it waits)."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_slots):
            if not preempt:
                return False
            victim = self.running.pop()
            group = [victim]
            if victim.group_id is not None:
                group += [r for r in self.running if r.group_id == victim.group_id]
                self.running = [r for r in self.running if r.group_id != victim.group_id]
            for member in group:
                self._unplan(plan, member)
                self._preempt(member)
            if request in group:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        assert not request.num_pending, request.request_id  # (a step scheduled ahead never preempts)
        self.kv_cache.free(request.request_id)
        self._sent.pop(request.request_id, None)
        self._preempted.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- the plan ----

    def _plan_add(self, plan: StepPlan, request: Request, num_new: int, drafts: list[int], propose: int) -> None:
        """Schedule `num_new` tokens of the request (its drafts among them; `propose` drafts to make after the
        step): its whole data if the batch does not hold it yet, else the tokens and blocks it gained since it last
        ran, and where a verify step rejected drafts since, its computed tokens and blocks as they are now."""
        rid, kv, num_tokens = request.request_id, self.kv_cache, request.num_tokens
        plan.request_ids.append(rid)
        plan.num_new_tokens.append(num_new)
        if drafts:
            plan.spec_token_ids[rid] = drafts
        if propose:
            plan.propose[rid] = propose
        num_blocks = kv.num_blocks_owned(rid)
        sent = self._sent.get(rid)
        if sent is None:
            plan.new_requests.append(NewRequest(
                request_id=rid, slot=kv.row(rid), token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=request.num_computed_tokens,
                block_ids=kv.block_ids(rid), params=request.params, min_tokens_stop_ids=request.stop_token_ids))
        else:
            if num_tokens > sent.tokens:
                plan.new_token_ids[rid] = request.token_ids_slice(sent.tokens, num_tokens)
            if request.num_computed_tokens != sent.computed:
                plan.computed_tokens[rid] = request.num_computed_tokens
            if sent.trimmed:
                plan.kept_blocks[rid] = sent.blocks
            if num_blocks > sent.blocks:
                plan.new_block_ids[rid] = kv.block_ids(rid, sent.blocks)
        self._sent[rid] = _Sent(num_tokens, num_blocks, request.num_computed_tokens + num_new)

    def _unplan(self, plan: StepPlan, request: Request) -> None:
        """Take a request this plan already scheduled back out of it (its group is being preempted)."""
        rid = request.request_id
        if rid not in plan.request_ids:
            return
        at = plan.request_ids.index(rid)
        del plan.request_ids[at], plan.num_new_tokens[at]
        plan.new_requests = [new for new in plan.new_requests if new.request_id != rid]
        for entries in (plan.new_token_ids, plan.new_block_ids, plan.spec_token_ids, plan.propose,
                        plan.computed_tokens, plan.kept_blocks):
            entries.pop(rid, None)

    def _order(self, plan: StepPlan, requests: dict[str, Request]) -> None:
        """The batch order the runners take: requests computing one token first (the decodes; an admitted prompt of
        one token too), then the rest; and whether any prompt is computed."""
        order = sorted(range(len(plan.request_ids)), key=lambda i: plan.num_new_tokens[i] > 1)
        plan.request_ids = [plan.request_ids[i] for i in order]
        plan.num_new_tokens = [plan.num_new_tokens[i] for i in order]
        plan.is_prefill = any(requests[rid].num_computed_tokens < requests[rid].num_prompt_tokens
                              for rid in plan.request_ids)

    def _commit(self, plan: StepPlan, requests: dict[str, Request]) -> None:
        """The requests whose step computes their last token (with the drafts it verifies), which sample (or pool) in
        it; then the plan's tokens counted computed as it goes out, and the token each request that samples gets as
        pending (update() replaces it with the sampled one): a step scheduled before this one's update sees both."""
        spec = plan.spec_token_ids
        for rid, num_new in zip(plan.request_ids, plan.num_new_tokens):
            request = requests[rid]
            if request.num_computed_tokens + num_new >= request.num_tokens + (len(spec[rid]) if rid in spec else 0):
                plan.emitting.append(rid)
                if not request.pooling:
                    request.num_pending += 1
            request.num_computed_tokens += num_new

    def _grammar_bitmask(self, plan: StepPlan, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The tokens each structured-output request that samples in this step may take (None if none samples)."""
        # In the sampled logits' order: the requests that sample, each with the drafts it verifies (a row for its
        # last token, then one after each draft).
        sampling = [(requests[rid], plan.spec_token_ids.get(rid, [])) for rid in plan.emitting]
        if not any(request.grammar is not None for request, _ in sampling):
            return None
        bitmask = allocate_bitmask(sum(1 + len(drafts) for _, drafts in sampling), self.vocab_size)
        rows, at = [], 0
        for request, drafts in sampling:
            if request.grammar is not None:
                request.grammar.fill(bitmask, at)
                for i, token in enumerate(drafts, start=1):  # (_drafts kept only drafts the grammar takes)
                    request.grammar.accept(token)
                    request.grammar.fill(bitmask, at + i)
                if drafts:
                    request.grammar.rollback(len(drafts))
                rows += range(at, at + 1 + len(drafts))
            at += 1 + len(drafts)
        return GrammarBitmask(rows, bitmask)

    @property
    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage(), self.num_preemptions,
                              kv.prefix_queries, kv.prefix_hits, self.spec_stats + SpecDecodeStats())


@dataclass(slots=True)
class _Sent:
    """What the runners' batch holds of a request, as the last plan that scheduled it left it."""

    tokens: int
    blocks: int  # of its blocks, those the batch has that are still the request's
    computed: int  # the computed tokens the batch counts (a verify step's drafts among them)
    trimmed: bool = False  # blocks past `blocks` were given back since: the batch drops them


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What a server's metrics report of a scheduler: its queues now, the KV cache's use, preemptions and prefix-cache
    lookups so far (in prompt tokens), speculative decoding's counts so far (a copy)."""

    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    spec_decode: SpecDecodeStats

    @classmethod
    def idle(cls) -> SchedulerStats:
        """A scheduler that has run nothing yet."""
        return cls(0, 0, 0.0, 0, 0, 0, SpecDecodeStats())


def _penalised(request: Request) -> bool:
    return not request.pooling and request.params.uses_penalties


def _advance_grammar(request: Request, token_id: int) -> bool:
    """Move the request's matcher past its new token; True when that ends the request where check_stop would not
    (its grammar ended on a stop token that ignore_eos does not stop on, or on its last token where the model has
    no stop token)."""
    if not request.grammar.accept(token_id):
        # Only possible when a min_tokens mask removed every token the grammar allowed (its stop tokens).
        logger.error("request %s: token %d is outside its structured-output grammar; the request stops",
                     request.request_id, token_id)
        return True
    return request.grammar.terminated and token_id not in request.stop_token_ids
