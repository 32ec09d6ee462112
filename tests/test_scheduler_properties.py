"""A hypothesis state machine over the real Scheduler and KVCacheManager in the engine's default configuration (chunked
prefill, prefix caching) with a cache small enough to preempt: requests with shared prefixes, groups of n > 1 (the
rest of a group joins when its first completion has sampled, as the engine adds them), structured-output requests,
stop tokens, aborts; steps scheduled ahead of the last one's update (async scheduling), their pending tokens' ids
filled from the step before's samples. The "model" writes each scheduled token's id into a shadow of the cache slots.

Checked after every rule: blocks are conserved and each block's reference count is the number of requests holding
it; every running request's slots for positions [0, num_computed_tokens) hold exactly its tokens (so a prefix-cache
hit is only ever on equal token ids); a plan keeps the token budget and max_num_seqs, puts decodes first, schedules
every running decode that was not preempted (ahead: preempts nothing, leaves out a decode only for want of a block
or where its pending token is its last), and admits the waiting queue's head whenever it clearly fits (no
request starves); the structured-output bitmask has a row exactly for each constrained request that samples; a
finished or aborted request holds no block and sits in no queue.
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.engine.scheduler import Scheduler
from mini_infer.runner.plan import PLACEHOLDER
from mini_infer.runner.sampler import SamplerOutput
from mini_infer.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET, VOCAB = 2, 10, 4, 8, 32
EOS = 17  # hypothesis draws the ends of a range most often: a stop token in the middle ends fewer requests at once
# Prompts from three shared stems, so that prefix-cache hits happen.
STEMS = ([1, 2, 3, 4], [1, 2, 4, 3], [3, 3, 3, 3])


class FakeGrammar:
    """A structured-output grammar that allows every token and ends after `length` of them."""

    def __init__(self, length: int) -> None:
        self.length, self.accepted = length, 0

    def fill(self, bitmask, row) -> None:
        pass

    def accept(self, token_id: int) -> bool:
        self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        return self.accepted >= self.length


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, 64)
        self.scheduler = Scheduler(self.kv, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, vocab_size=VOCAB)
        self.slots: dict[int, int] = {}  # cache slot -> the token id the "model" wrote there
        self.unfinished: dict[str, Request] = {}
        self.held: dict[str, list[Request]] = {}  # group id -> completions that join after the first samples
        self.gone: list[Request] = []  # finished or aborted
        self.ids = itertools.count()
        self.in_flight = None  # (plan, its sampled tokens): a step scheduled ahead of, its update not yet run

    # ---- rules ----

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(1, VOCAB - 1), max_size=3),
          max_tokens=st.integers(1, 10), n=st.integers(1, 3), ignore_eos=st.booleans(),
          grammar_length=st.none() | st.integers(4, 12))
    def add(self, stem, tail, max_tokens, n, ignore_eos, grammar_length):
        prompt = stem[: 1 + len(tail)] + tail  # 1-7 tokens
        blocks, shared = self.kv.blocks_for(len(prompt) + max_tokens), (len(prompt) - 1) // BLOCK_SIZE
        if shared + n * (blocks - shared) > NUM_BLOCKS:
            return  # the engine refuses a group that cannot fit the cache together (InputProcessor)
        group = f"g{next(self.ids)}" if n > 1 else None
        requests = []
        for index in range(n):
            request = Request(request_id=f"r{next(self.ids)}", prompt=None, prompt_token_ids=list(prompt),
                              params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                              max_tokens=max_tokens, eos_token_ids=frozenset() if ignore_eos else frozenset({EOS}),
                              detokenizer=None, index=index, group_id=group)
            if grammar_length is not None:
                request.grammar = FakeGrammar(grammar_length)
            requests.append(request)
            self.unfinished[request.request_id] = request
        self.scheduler.add(requests[0])
        if requests[1:]:
            self.held[group] = requests[1:]

    @rule(data=st.data(), count=st.integers(1, 4), ahead=st.booleans())
    def steps(self, data, count, ahead):
        """`count` steps; with `ahead`, each scheduled before the last one's update (async scheduling) where the
        scheduler allows it."""
        for _ in range(count):
            self.step(data, ahead)
            self.blocks_are_conserved_and_counted_exactly()
            self.check_cache_contents()

    def step(self, data, ahead=False):
        if self.in_flight is not None and not (ahead and self.scheduler.can_run_ahead()):
            self.finish(*self.in_flight)
            self.in_flight = None
        run_ahead = self.in_flight is not None
        gaps = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.scheduler.running}
        pending = {r.request_id: r.num_pending for r in self.scheduler.running}
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        plan = self.scheduler.schedule(run_ahead=run_ahead)
        scheduled = dict(zip(plan.request_ids, plan.num_new_tokens))
        running = {r.request_id: r for r in self.scheduler.running}
        # (schedule() counts the plan's tokens computed as it sends it: each request's step starts before them)
        starts = {rid: running[rid].num_computed_tokens - num_new for rid, num_new in scheduled.items()}
        preempted = set(plan.preempted_ids)
        # The plan: budget, sequence slots, decodes first, every surviving decode in it (scheduled ahead: none
        # preempted, and a decode left out only where its pending token is its last or no block is free).
        assert plan.num_tokens <= BUDGET and len(self.scheduler.running) <= MAX_SEQS
        assert plan.num_new_tokens == sorted(plan.num_new_tokens, key=lambda count: count > 1)
        assert not (run_ahead and preempted)
        for rid, gap in gaps.items():
            if gap == 1 and rid not in preempted and rid not in scheduled:
                request = running[rid]
                assert run_ahead and (request.num_output_tokens + request.num_pending >= request.max_tokens
                                      or self.kv.num_free_blocks == 0), f"decode of {rid} left out"
        # The waiting head is admitted when it clearly fits (nothing preempted, a free sequence slot, budget left).
        if head is not None and head in self.scheduler.waiting and not preempted:
            clearly_fits = (len(self.scheduler.running) < MAX_SEQS and plan.num_tokens < BUDGET
                            and self.kv.num_free_blocks >= (self.kv.blocks_for(head.num_tokens)
                                                            + len(self.scheduler.running) + 1))
            assert not clearly_fits, f"{head.request_id} was not admitted though it fits"
        self.check_cache_contents(starts)  # a prefix hit taken over at admission holds the request's own tokens
        # The structured-output rows: one for each constrained request that samples (one more token pending), in
        # sampling order.
        sampling = [running[rid] for rid in plan.request_ids if running[rid].num_pending > pending.get(rid, 0)]
        constrained = [row for row, request in enumerate(sampling) if request.grammar is not None]
        assert (plan.grammar.rows if plan.grammar is not None else []) == constrained
        # The "model": writes each scheduled token's id into its slot (a pending one's is the step before's sample,
        # as the runner fills it on the device), samples a token for each sampling row.
        drawn = dict(zip(self.in_flight[0].emitting, self.in_flight[1])) if run_ahead else {}
        for rid, num_new in scheduled.items():
            request = running[rid]
            for position in range(starts[rid], starts[rid] + num_new):
                block = self.kv.block_ids(rid)[position // BLOCK_SIZE]
                token = request.token_ids_slice(position, position + 1)[0]
                self.slots[block * BLOCK_SIZE + position % BLOCK_SIZE] = drawn[rid] if token == PLACEHOLDER else token
        tokens = [data.draw(st.integers(0, VOCAB - 1)) for _ in sampling]
        if run_ahead:
            self.finish(*self.in_flight)
        self.in_flight = None
        if ahead and plan.request_ids:
            self.in_flight = plan, tokens
        else:
            self.finish(plan, tokens)

    def finish(self, plan, tokens) -> None:
        """The update of a step the "model" has run, with the tokens it sampled."""
        update = self.scheduler.update(plan, SamplerOutput(tokens, [None] * len(tokens)))
        for request, _, _ in update.sampled:
            if request.group_id in self.held and request.index == 0 and request.num_output_tokens == 1:
                for sibling in self.held.pop(request.group_id):
                    self.scheduler.add(sibling)
        for request in update.finished:
            self.retire(request)

    @precondition(lambda self: self.unfinished)
    @rule(data=st.data(), now=st.integers(0, 3))
    def abort(self, data, now):
        """Abort a request, with the rest of its group (as the engine aborts a request of n > 1); one time in four, so
        that requests live long enough to crowd the cache."""
        if now:
            return
        request = data.draw(st.sampled_from(sorted(self.unfinished.values(), key=lambda r: r.request_id)))
        group = [r for r in self.unfinished.values() if r.group_id == request.group_id] if request.group_id \
            else [request]
        held = self.held.pop(request.group_id, [])
        for member in group:
            if member not in held:  # a held completion was never scheduled
                self.scheduler.finish(member, RequestStatus.FINISHED_ABORTED)
            self.retire(member)

    def retire(self, request: Request) -> None:
        del self.unfinished[request.request_id]
        self.gone.append(request)

    # ---- invariants ----

    @invariant()
    def blocks_are_conserved_and_counted_exactly(self):
        holders = {}
        for request in self.scheduler.running:
            for block in self.kv.block_ids(request.request_id):
                holders[block] = holders.get(block, 0) + 1
        assert not any(self.kv.block_ids(r.request_id) for r in self.scheduler.waiting)
        assert all(self.kv.ref_count(block) == holders.get(block, 0) for block in range(NUM_BLOCKS))
        assert sorted(self.kv.free_blocks()) == [b for b in range(NUM_BLOCKS) if b not in holders]
        assert self.kv.num_free_blocks + len(holders) == NUM_BLOCKS

    @invariant()
    def check_cache_contents(self, computed: dict[str, int] | None = None):
        """Each running request's computed positions hold its tokens (`computed`: mid-step, each scheduled request's
        positions before its step)."""
        for request in self.scheduler.running:
            blocks = self.kv.block_ids(request.request_id)
            for position in range((computed or {}).get(request.request_id, request.num_computed_tokens)):
                slot = blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                assert self.slots.get(slot) == request.token_ids_slice(position, position + 1)[0], \
                    f"{request.request_id} position {position}"

    @invariant()
    def retired_requests_hold_nothing(self):
        queued = {r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting)}
        for request in self.gone:
            assert request.request_id not in queued and self.kv.num_blocks_owned(request.request_id) == 0

    def teardown(self):
        """Every request ends: step until the queues drain (each step computes something), then all blocks are
        free."""
        if self.in_flight is not None:
            self.finish(*self.in_flight)
        for _ in range(500):
            if not self.scheduler.has_unfinished() and not self.held:
                break
            plan = self.scheduler.schedule()
            # Each step computes something, unless it preempted (a whole group, say), which the next one re-admits.
            assert plan.request_ids or plan.preempted_ids, "unfinished requests but nothing scheduled or preempted"
            running = {r.request_id: r for r in self.scheduler.running}
            rows = sum(1 for rid in plan.request_ids if running[rid].num_pending)
            update = self.scheduler.update(plan, SamplerOutput([1] * rows, [None] * rows))
            for request, _, _ in update.sampled:
                for sibling in self.held.pop(request.group_id, []) if request.index == 0 else []:
                    self.scheduler.add(sibling)
        assert not self.scheduler.has_unfinished() and not self.held
        assert self.kv.num_free_blocks == NUM_BLOCKS


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase
