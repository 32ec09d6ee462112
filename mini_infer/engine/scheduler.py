"""Scheduler: waiting and running queues, admission, preemption; decides what each step computes.

Every running request has num_tokens - num_computed_tokens tokens to compute: 1 in decode (the token sampled
last), more while its prompt (or a preempted request's recompute) is being prefilled. A newly admitted request
first takes over the KV blocks of its longest cached prompt prefix (KVCacheManager.match_prefix), so it starts
with those tokens computed.

Without chunked prefill, a step is a prefill step (newly admitted prompts, each whole, packed together) when
anything can be admitted, else a decode step (one token for every running request). With chunked prefill, a step
has a token budget (max_num_batched_tokens): decode tokens of running requests first, then chunks of prompts
still being prefilled, then chunks of newly admitted prompts, until the budget is spent; a long prompt spreads
over several steps, and the running streams keep decoding meanwhile. A request samples in the step that computes
its last token.

When a decode token finds no free block, the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (from its cached prefix, if its blocks are still cached by then). A completion of a
request of n > 1 goes with its running siblings (taken out of the step if they were in it already): the group comes
back whole, and its prompt's blocks, which the siblings share, are freed rather than kept for one of them.

Each step's decision goes out as a StepPlan (plain data): a request's tokens, blocks and sampling parameters
once, when it enters the runners' batch, then only what it gained since it last ran, and who left the batch.
"""

from __future__ import annotations

from collections import deque

from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.runner.plan import NewRequest, StepPlan


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = False) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        # What the runners' batch holds of each request in it: (tokens, blocks) as last sent.
        self._sent: dict[str, tuple[int, int]] = {}
        self._left: list[str] = []  # finished since the last plan
        self._preempted: list[str] = []  # preempted while this plan is made

    def _plan_add(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """Schedule `num_new` tokens of the request: its whole data if the batch does not hold it yet, else
        the tokens and blocks it gained since it last ran."""
        rid, kv = request.request_id, self.kv_cache
        plan.request_ids.append(rid)
        plan.num_new_tokens.append(num_new)
        num_blocks = kv.num_blocks_owned(rid)
        sent = self._sent.get(rid)
        if sent is None:
            plan.new_requests.append(NewRequest(
                request_id=rid, slot=kv.row(rid), token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=request.num_computed_tokens,
                block_ids=kv.block_ids(rid), params=request.params, min_tokens_stop_ids=request.stop_token_ids))
        else:
            sent_tokens, sent_blocks = sent
            if request.num_tokens > sent_tokens:
                plan.new_token_ids[rid] = request.token_ids_slice(sent_tokens, request.num_tokens)
            if num_blocks > sent_blocks:
                plan.new_block_ids[rid] = kv.block_ids(rid, sent_blocks)
        self._sent[rid] = (request.num_tokens, num_blocks)

    def _seal(self, plan: StepPlan) -> StepPlan:
        """Hand the plan the departures since the last plan."""
        plan.finished_ids, self._left = self._left, []
        plan.preempted_ids, self._preempted = self._preempted, []
        return plan

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        if self.enable_chunked_prefill:
            return self._seal(self._schedule_chunked())
        if self.waiting:
            plan = self._schedule_prefill()
            if plan.request_ids:
                return self._seal(plan)
        return self._seal(self._schedule_decode())

    # ---- admission ----

    def _admit(self, request: Request, budget: int, *, whole: bool, reserve: int) -> int:
        """Admit the first waiting request with its cached prefix and up to `budget` more tokens (all of them
        when `whole`); the tokens scheduled, 0 when it cannot be admitted now."""
        # A request that wants prompt logprobs computes its whole prompt (cached positions would have none), as vLLM.
        hits = [] if request.params.prompt_logprobs is not None else self.kv_cache.match_prefix(request.all_token_ids)
        cached = len(hits) * self.kv_cache.block_size
        remaining = request.num_tokens - cached
        num_new = min(remaining, budget)
        if num_new < 1 or (whole and num_new < remaining):
            return 0
        if not self.kv_cache.allocate_with_prefix(request.request_id, hits, cached + num_new, reserve):
            return 0
        self.kv_cache.count_prefix_query(request.num_tokens, cached)
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = cached
        self.running.append(request)
        return num_new

    def _schedule_prefill(self) -> StepPlan:
        output = StepPlan(is_prefill=True)
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # Leave one block per running request so the next decode step need not preempt what we admit; count
            # the slot of the token this prefill samples, which that step computes.
            extra = self.kv_cache.blocks_for(request.num_tokens + 1) - self.kv_cache.blocks_for(request.num_tokens)
            num_new = self._admit(request, budget, whole=True, reserve=len(self.running) + extra)
            if not num_new:
                break
            self._plan_add(output, request, num_new)
            budget -= num_new
        return output

    # ---- decode ----

    def _schedule_decode(self) -> StepPlan:
        output = StepPlan(is_prefill=False)
        for request in list(self.running):
            # (one preempted in this loop, as a victim or a victim's sibling, is waiting again)
            if request.status is RequestStatus.RUNNING and self._grow_or_preempt(request, output):
                self._plan_add(output, request, 1)
        return output

    def _grow_or_preempt(self, request: Request, output: StepPlan) -> bool:
        """A slot for the request's next token, preempting the most recently admitted running requests (each with
        its group) until there is one; False when the request itself had to go."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + 1):
            victim = self.running.pop()
            group = [victim]
            if victim.group_id is not None:
                group += [r for r in self.running if r.group_id == victim.group_id]
                self.running = [r for r in self.running if r.group_id != victim.group_id]
            for member in group:
                self._unplan(output, member)
                self._preempt(member)
            if request in group:
                return False
        return True

    def _unplan(self, plan: StepPlan, request: Request) -> None:
        """Take a request this plan already scheduled back out of it (its group is being preempted)."""
        rid = request.request_id
        if rid not in plan.request_ids:
            return
        at = plan.request_ids.index(rid)
        del plan.request_ids[at], plan.num_new_tokens[at]
        plan.new_requests = [new for new in plan.new_requests if new.request_id != rid]
        plan.new_token_ids.pop(rid, None)
        plan.new_block_ids.pop(rid, None)

    # ---- chunked prefill ----

    def _schedule_chunked(self) -> StepPlan:
        output = StepPlan(is_prefill=False)
        budget = self.max_num_batched_tokens
        preempted_before = len(self._preempted)
        for request in list(self.running):  # decode tokens first, in admission order
            if budget <= 0:
                break
            if (request.status is RequestStatus.RUNNING and request.num_tokens - request.num_computed_tokens == 1
                    and self._grow_or_preempt(request, output)):
                self._plan_add(output, request, 1)
                budget -= 1
        budget = self.max_num_batched_tokens - output.num_tokens  # a preempted group's planned tokens come back
        for request in self.running:  # then the prompts already being prefilled
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1 and budget > 0:
                num_new = min(remaining, budget)
                if not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                    break  # no room for more prompt tokens this step
                self._plan_add(output, request, num_new)
                output.is_prefill = True
                budget -= num_new
        # Then new requests, unless this step had to preempt (re-admitting a victim now would only thrash).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and len(self._preempted) == preempted_before:
            request = self.waiting[0]
            num_new = self._admit(request, budget, whole=False, reserve=len(self.running))
            if not num_new:
                break
            self._plan_add(output, request, num_new)
            output.is_prefill = True
            budget -= num_new
        return output

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        self._sent.pop(request.request_id, None)
        self._preempted.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a running or waiting request and return its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        self._sent.pop(request.request_id, None)
        self._left.append(request.request_id)
