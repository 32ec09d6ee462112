"""Scheduler: waiting and running queues, admission, preemption; decides what each step computes.

A step is a prefill step (newly admitted prompts packed together) when anything can be admitted, else a
decode step (one token for every running request). When a decode step runs out of blocks, the most
recently admitted running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    is_prefill: bool
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per scheduled request
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        if self.waiting:
            output = self._schedule_prefill()
            if output.requests:
                return output
        return self._schedule_decode()

    def _schedule_prefill(self) -> SchedulerOutput:
        output = SchedulerOutput(is_prefill=True)
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # A preempted request recomputes everything it had: prompt and the tokens generated so far.
            num_new = request.num_tokens - request.num_computed_tokens
            # Leave one block per running request so the next decode step need not preempt what we admit;
            # count the slot of the token this prefill samples, which that step computes.
            spare = self.kv_cache.num_free_blocks - self.kv_cache.blocks_for(request.num_tokens + 1)
            if num_new > budget or spare < len(self.running):
                break
            if not self.kv_cache.allocate_slots(request.request_id, request.num_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.requests.append(request)
            output.num_new_tokens.append(num_new)
            budget -= num_new
        return output

    def _schedule_decode(self) -> SchedulerOutput:
        output = SchedulerOutput(is_prefill=False)
        index = 0
        while index < len(self.running):
            request = self.running[index]
            # The last sampled token is the one this step computes; it needs a slot.
            if self.kv_cache.allocate_slots(request.request_id, request.num_tokens):
                output.requests.append(request)
                output.num_new_tokens.append(1)
                index += 1
            else:
                victim = self.running.pop()  # may be `request` itself, which ends the loop
                self._preempt(victim)
                output.preempted.append(victim)
        return output

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
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
