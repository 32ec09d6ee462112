"""Scheduler: admission limits, continuous batching, preemption order and recompute (Request objects driven
by hand, no model), then LLMEngine-level rejection, abort and a small-cache stress run on a tiny checkpoint."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from conftest import build_hf_model, save_hf_model
from mini_infer.config import DEFAULT_CHUNKED_BUDGET, EngineConfig
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.engine.scheduler import Scheduler
from mini_infer.runner.plan import StepPlan
from mini_infer.runner.sampler import SamplerOutput
from mini_infer.sampling_params import SamplingParams

SAMPLED_TOKEN = 7


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8) -> Request:
    """A prompt of its own (no two requests share a prefix the cache could serve)."""
    first = 1000 * (sum(map(ord, request_id)) % 97 + 1)
    return Request(request_id=request_id, prompt=None, prompt_token_ids=list(range(first, first + prompt_len)),
                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens,
                   eos_token_ids=frozenset(), detokenizer=None)


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                   max_blocks_per_seq: int = 64, **settings) -> Scheduler:
    """A scheduler as the engine builds it by default (chunked prefill, prefix caching), but for these sizes."""
    kv = KVCacheManager(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **settings)


@dataclass
class Scheduled:
    """A step's plan read back as the Request objects it names (the plan itself carries only their ids)."""

    plan: StepPlan
    requests: list[Request]
    preempted: list[Request]

    def __getattr__(self, name):
        return getattr(self.plan, name)


def schedule(scheduler: Scheduler) -> Scheduled:
    known = {r.request_id: r for r in (*scheduler.running, *scheduler.waiting)}
    plan = scheduler.schedule()
    return Scheduled(plan, [known[rid] for rid in plan.request_ids], [known[rid] for rid in plan.preempted_ids])


def sampling_rows(scheduler: Scheduler, plan: StepPlan) -> int:
    """How many requests the plan's step samples for: those it brings to their last token (schedule() counts the
    token each will sample as pending)."""
    running = {r.request_id: r for r in scheduler.running}
    return sum(1 for rid in plan.request_ids if running[rid].num_pending)


def complete(scheduler: Scheduler, output: Scheduled) -> None:
    """What the engine does after the forward: the scheduler's update, with SAMPLED_TOKEN for every row that
    samples (requests retire at max_tokens)."""
    rows = sampling_rows(scheduler, output.plan)
    scheduler.update(output.plan, SamplerOutput([SAMPLED_TOKEN] * rows, [None] * rows))


def step(scheduler: Scheduler) -> Scheduled:
    output = schedule(scheduler)
    complete(scheduler, output)
    return output


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_the_scheduler_defaults_are_the_engines():
    scheduler, defaults = Scheduler(KVCacheManager(4, 4, 2, 4)), EngineConfig.__dataclass_fields__
    assert scheduler.enable_chunked_prefill is defaults["enable_chunked_prefill"].default is True
    assert scheduler.max_num_seqs == defaults["max_num_seqs"].default
    assert scheduler.max_num_batched_tokens == DEFAULT_CHUNKED_BUDGET


# ---- admission ----

def test_admission_respects_max_num_seqs():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    for i in range(4):
        scheduler.add(make_request(f"r{i}", 3))
    first = step(scheduler)
    assert first.is_prefill and ids(first.requests) == ["r0", "r1"] and first.num_new_tokens == [3, 3]
    assert ids(scheduler.waiting) == ["r2", "r3"]
    second = step(scheduler)  # the queue is not empty, but every sequence slot is taken
    assert not second.is_prefill and ids(second.requests) == ["r0", "r1"] and second.num_new_tokens == [1, 1]


def test_one_budget_takes_decodes_first_then_prompts_in_order():
    """Running requests' decode tokens first, then waiting prompts in arrival order, while the budget lasts; a
    prompt may take only part of it (a chunk) and finish in the next steps beside the decodes."""
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12)
    for i, n in enumerate([5, 10, 1]):
        scheduler.add(make_request(f"r{i}", n))
    first = step(scheduler)
    assert ids(first.requests) == ["r0", "r1"] and first.num_new_tokens == [5, 7]  # r1: a chunk of 7
    assert ids(scheduler.waiting) == ["r2"]  # r2 fits nothing left: it does not overtake r1
    second = step(scheduler)  # r0 decodes, r1 finishes its prompt, r2's prompt of one token: decodes first
    assert ids(second.requests) == ["r0", "r2", "r1"] and second.num_new_tokens == [1, 1, 3]
    assert second.is_prefill and second.num_tokens == 5
    third = step(scheduler)
    assert ids(third.requests) == ["r0", "r1", "r2"] and third.num_new_tokens == [1, 1, 1] and not third.is_prefill


def test_without_chunked_prefill_a_prompt_is_admitted_whole():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12, enable_chunked_prefill=False)
    for i, n in enumerate([5, 10, 1]):
        scheduler.add(make_request(f"r{i}", n))
    first = step(scheduler)
    assert ids(first.requests) == ["r0"]  # r1 does not fit whole, and r2 does not overtake it
    second = step(scheduler)
    assert ids(second.requests) == ["r0", "r2", "r1"] and second.num_new_tokens == [1, 1, 10]


@pytest.mark.parametrize("num_blocks,admitted", [(4, False), (5, True)])
def test_admission_leaves_a_spare_block_per_running_request(num_blocks, admitted):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4)
    scheduler.add(make_request("old", 3))
    step(scheduler)  # old owns 1 block
    scheduler.add(make_request("new", 9))  # 3 blocks
    output = step(scheduler)
    # Admitting `new` leaves num_blocks - 4 free blocks; `old` needs one kept for its next decode.
    assert output.is_prefill is admitted
    assert ids(output.requests) == (["old", "new"] if admitted else ["old"])
    assert scheduler.kv_cache.num_free_blocks == (num_blocks - 4 if admitted else num_blocks - 1)


def test_admission_stops_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    for name, n in [("a", 8), ("b", 11), ("c", 4)]:
        scheduler.add(make_request(name, n))
    first = step(scheduler)
    assert ids(first.requests) == ["a", "b"]  # c would leave 0 free blocks for 2 running requests
    assert scheduler.kv_cache.num_free_blocks == 1
    second = step(scheduler)
    assert not second.is_prefill and ids(second.requests) == ["a", "b"] and not second.preempted
    assert ids(scheduler.waiting) == ["c"] and scheduler.kv_cache.num_blocks_owned("c") == 0


def test_continuous_batching_admits_while_others_decode():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    scheduler.add(make_request("a", 4, max_tokens=2))
    scheduler.add(make_request("b", 3, max_tokens=4))
    scheduler.add(make_request("c", 5, max_tokens=2))
    assert ids(step(scheduler).requests) == ["a", "b"]
    second = step(scheduler)
    assert not second.is_prefill and ids(second.requests) == ["a", "b"]
    assert scheduler.kv_cache.block_ids("a") == []  # a finished: its blocks went back
    third = step(scheduler)  # c joins while b is mid-generation
    assert third.is_prefill and ids(third.requests) == ["b", "c"] and third.num_new_tokens == [1, 5]
    fourth = step(scheduler)
    assert not fourth.is_prefill and ids(fourth.requests) == ["b", "c"] and fourth.num_new_tokens == [1, 1]
    assert [r.num_output_tokens for r in fourth.requests] == [4, 2] and all(r.finished for r in fourth.requests)
    assert not scheduler.has_unfinished()
    assert scheduler.kv_cache.num_free_blocks == 64


def test_finish_retires_waiting_and_running_requests():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    running, waiting = make_request("running", 6), make_request("waiting", 2)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 6
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting and waiting.status is RequestStatus.FINISHED_ABORTED
    scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.running and scheduler.kv_cache.num_free_blocks == 8
    assert not scheduler.has_unfinished()


def test_update_registers_filled_blocks_and_stops_on_stop_tokens():
    """update() counts the computed tokens (a chunk samples nothing), registers the blocks they filled in the prefix
    cache, appends each sampled token and retires a request at its stop token, its blocks returned."""
    scheduler = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=4)
    request = Request(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3, 4, 5], params=SamplingParams(),
                      max_tokens=10, eos_token_ids=frozenset({9}), detokenizer=None)
    scheduler.add(request)
    first = schedule(scheduler)
    assert first.num_new_tokens == [4] and sampling_rows(scheduler, first.plan) == 0
    update = scheduler.update(first.plan, None)
    assert request.num_computed_tokens == 4 and not update.sampled and request.num_output_tokens == 0
    assert scheduler.kv_cache.match_prefix([1, 2, 3, 4, 5]) == scheduler.kv_cache.block_ids("r")[:2]
    second = schedule(scheduler)
    update = scheduler.update(second.plan, SamplerOutput([6], [None]))
    assert [(r.request_id, token) for r, token, _ in update.sampled] == [("r", 6)] and not update.finished
    third = schedule(scheduler)
    update = scheduler.update(third.plan, SamplerOutput([9], [None]))
    assert update.finished == [request] and request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [6, 9] and scheduler.kv_cache.num_free_blocks == 8


# ---- preemption ----

def test_decode_preempts_most_recent_request_to_front_of_queue():
    scheduler = make_scheduler(num_blocks=6, block_size=2)
    for name in "abc":
        scheduler.add(make_request(name, 2))
    assert ids(step(scheduler).requests) == ["a", "b", "c"]  # 3 blocks used, 3 spare
    scheduler.add(make_request("late", 10))  # 5 blocks: cannot be admitted
    assert ids(step(scheduler).requests) == ["a", "b", "c"]  # each grows to 2 blocks
    assert ids(step(scheduler).requests) == ["a", "b", "c"]  # 4 tokens still fit 2 blocks
    assert scheduler.kv_cache.num_free_blocks == 0
    c = scheduler.running[2]
    output = step(scheduler)  # each needs a third block
    assert not output.is_prefill
    assert ids(output.preempted) == ["c"] and ids(output.requests) == ["a", "b"]
    assert ids(scheduler.running) == ["a", "b"]
    assert ids(scheduler.waiting) == ["c", "late"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.num_output_tokens == 3  # generated tokens are kept, to be recomputed
    assert scheduler.kv_cache.block_ids("c") == [] and scheduler.num_preemptions == 1


def test_several_victims_keep_their_relative_order_and_are_recomputed():
    # Without a prefix cache: the recompute below computes every token again.
    scheduler = Scheduler(KVCacheManager(8, 2, 8, 64, enable_prefix_caching=False), max_num_batched_tokens=256)
    for name, max_tokens in [("a", 4), ("b", 4), ("c", 6), ("d", 6)]:
        scheduler.add(make_request(name, 2, max_tokens))
    assert ids(step(scheduler).requests) == ["a", "b", "c", "d"]
    scheduler.add(make_request("e", 10, max_tokens=2))
    step(scheduler)
    step(scheduler)
    output = step(scheduler)  # a needs a block: d goes; b's block is the last one; c then preempts itself
    assert ids(output.preempted) == ["d", "c"] and ids(output.requests) == ["a", "b"]
    assert ids(scheduler.waiting) == ["c", "d", "e"]
    assert [r.num_tokens for r in scheduler.waiting] == [5, 5, 10]
    # a and b finished at 4 tokens; c and d come back first, each prefilling prompt + generated tokens.
    assert not scheduler.running and scheduler.kv_cache.num_free_blocks == 8
    readmit = step(scheduler)
    assert readmit.is_prefill and ids(readmit.requests) == ["c", "d"] and readmit.num_new_tokens == [5, 5]
    assert [r.num_computed_tokens for r in readmit.requests] == [5, 5]
    assert [r.num_output_tokens for r in readmit.requests] == [4, 4]
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 8


def test_admitted_request_is_not_preempted_by_the_next_decode_step():
    """The scheduler reserves a block per running request so that "the next decode step need not preempt
    what we admit"; the request being admitted must be counted too, or a prompt ending on a block boundary
    is prefilled only to be thrown away one step later."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add(make_request("old", 4))
    step(scheduler)  # old: 5 tokens in 1 block; its next decode needs a second block
    scheduler.add(make_request("new", 8))  # 2 blocks; after its prefill, 9 tokens need 3
    admitted_at = {}
    for number in range(100):
        if not scheduler.has_unfinished():
            break
        output = step(scheduler)
        for request in output.requests:
            admitted_at.setdefault(request.request_id, number)
        thrown_away = [r.request_id for r in output.preempted if admitted_at.get(r.request_id) == number - 1]
        assert not thrown_away, f"{thrown_away} preempted by the step right after its prefill"
    assert scheduler.kv_cache.num_free_blocks == 4


# ---- LLMEngine: rejection, abort, stress ----

@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The model is tiny: with intra-op threads on a busy machine, each matmul waits ~15 ms for a
    descheduled worker, which made the stress test alone take 20 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(build_hf_model(seed=11, vocab_size=512), tmp_path_factory.mktemp("sched-model"))


def make_engine(model_dir, **kwargs) -> LLMEngine:
    config = dict(dtype="float32", block_size=4, num_kv_blocks=8, max_num_seqs=4, max_model_len=48)
    config.update(kwargs)
    if config["dtype"] in ("float32", "bfloat16"):  # one kernel path: the autotuner is not what these tests test
        config.setdefault("cpu_kernels", "on")
    return LLMEngine.from_args(str(model_dir), **config)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_end(engine: LLMEngine, max_steps: int = 1000) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert not engine.has_unfinished_requests()
    return finished


@pytest.mark.parametrize("prompt_len,max_tokens,message", [
    (10, 39, r"prompt \(10 tokens\) \+ max_tokens \(39\) = 49 exceeds max_model_len \(48\)"),
    (20, 20, r"needs 10 KV blocks but the whole cache has 8 \(block_size 4\)"),
    (10, None, r"max_tokens \(38\) needs 12 KV blocks but the whole cache has 8"),
    (48, 1, r"prompt has 48 tokens; max_model_len is 48"),
    (60, 1, r"prompt has 60 tokens; max_model_len is 48"),
])
def test_add_request_rejects_impossible_requests_and_keeps_serving(model_dir, prompt_len, max_tokens, message):
    engine = make_engine(model_dir)
    engine.add_request("ok-before", [5, 6, 7], greedy(4))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", list(range(1, prompt_len + 1)), greedy(max_tokens))
    assert "bad" not in engine.requests and engine.get_num_unfinished_requests() == 1
    # The whole cache exactly (32 tokens = 8 blocks) is allowed, and the rejected id is free to reuse.
    engine.add_request("bad", list(range(1, 21)), greedy(12))
    finished = run_to_end(engine)
    assert {rid: len(o.outputs[0].token_ids) for rid, o in finished.items()} == {"ok-before": 4, "bad": 12}
    assert all(o.outputs[0].finish_reason == "length" for o in finished.values())
    assert engine.kv_cache_usage() == 0.0


def test_a_group_that_cannot_fit_the_cache_together_is_refused(model_dir):
    """A group of n > 1 is preempted and re-admitted whole, so n completions that cannot be resident together would
    never finish: refused, naming n (or best_of); one that fits (the prompt's full blocks shared) runs."""
    engine = make_engine(model_dir)  # 8 blocks of 4
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks shared by the completions
    with pytest.raises(ValueError, match=r"3 completions \(n\) of a prompt of 9 tokens \+ max_tokens \(8\) need 11 KV "
                                         r"blocks together but the whole cache has 8") as error:
        engine.add_request("group", prompt, greedy(8, n=3))  # 5 blocks each at 17 tokens: 2 + 3 x 3
    assert error.value.field == "n" and not engine.requests
    with pytest.raises(ValueError, match=r"3 completions \(best_of\)"):
        engine.add_request("best", prompt, greedy(8, n=1, best_of=3))
    engine.add_request("fits", prompt, greedy(3, n=3))  # 3 blocks each at 12 tokens: 2 + 3 x 1
    finished = run_to_end(engine)
    assert [len(c.token_ids) for c in finished["fits"].outputs] == [3, 3, 3]
    assert engine.kv_cache_usage() == 0.0


def test_abort_waiting_and_running_requests_frees_blocks_at_once(model_dir):
    engine = make_engine(model_dir, num_kv_blocks=16, max_num_seqs=2)
    engine.add_request("a", list(range(1, 11)), greedy(20))
    engine.add_request("b", list(range(1, 7)), greedy(20))
    engine.add_request("c", list(range(1, 6)), greedy(3))
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]  # c waits: max_num_seqs is 2
    kv = engine.kv_cache
    assert kv.num_free_blocks == 16 - 3 - 2

    engine.abort_request("c")  # waiting: owns no blocks, leaves the queue
    assert kv.num_free_blocks == 11 and [r.request_id for r in engine.scheduler.waiting] == []
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["c"].finished and outputs["c"].outputs[0].finish_reason == "abort"
    assert outputs["c"].outputs[0].token_ids == []
    assert set(outputs) == {"a", "b", "c"}

    usage_before = engine.kv_cache_usage()
    engine.abort_request(["a", "unknown-id"])
    assert engine.kv_cache_usage() < usage_before
    assert kv.num_free_blocks == 16 - kv.num_blocks_owned("b") and kv.block_ids("a") == []
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["a"].finished and outputs["a"].outputs[0].finish_reason == "abort"
    assert len(outputs["a"].outputs[0].token_ids) == 2
    engine.abort_request("a")  # already aborted: ignored
    finished = run_to_end(engine)
    assert set(finished) == {"b"} and finished["b"].outputs[0].finish_reason == "length"
    assert len(finished["b"].outputs[0].token_ids) == 20
    assert engine.kv_cache_usage() == 0.0 and kv.num_free_blocks == 16


def test_abort_of_preempted_request(model_dir):
    engine = make_engine(model_dir, num_kv_blocks=6, max_model_len=24)
    engine.add_request("a", list(range(1, 9)), greedy(12))
    engine.add_request("b", list(range(1, 9)), greedy(12))
    for _ in range(30):
        engine.step()
        if engine.scheduler.num_preemptions:
            break
    preempted = engine.scheduler.waiting[0]
    assert preempted.num_preemptions == 1 and preempted.num_output_tokens > 0
    engine.abort_request(preempted.request_id)
    finished = run_to_end(engine)
    assert finished[preempted.request_id].outputs[0].finish_reason == "abort"
    assert [o.outputs[0].finish_reason for rid, o in finished.items() if rid != preempted.request_id] == ["length"]
    assert engine.kv_cache_usage() == 0.0 and engine.kv_cache.num_free_blocks == 6


def test_stress_tiny_cache_never_hangs_and_matches_unconstrained_run(model_dir):
    rng = random.Random(1234)
    workload = [(f"r{i}", [rng.randrange(1, 512) for _ in range(rng.randint(1, 20))], rng.randint(1, 12),
                 rng.randint(0, 40)) for i in range(30)]
    workload = [(rid, prompt, min(m, 32 - len(prompt)), t) for rid, prompt, m, t in workload]

    def run(engine: LLMEngine) -> tuple[dict[str, list[int]], int]:
        results, steps, pending = {}, 0, sorted(workload, key=lambda w: w[3])
        bound = sum(m for _, _, m, _ in workload)  # every step generates at least one token
        while pending or engine.has_unfinished_requests():
            while pending and (pending[0][3] <= steps or not engine.has_unfinished_requests()):
                rid, prompt, max_tokens, _ = pending.pop(0)
                engine.add_request(rid, prompt, greedy(max_tokens))
            for output in engine.step():
                if output.finished:
                    assert output.outputs[0].finish_reason == "length"
                    results[output.request_id] = output.outputs[0].token_ids
            steps += 1
            assert steps <= bound, "the engine stopped making progress"
        return results, steps

    small = make_engine(model_dir, dtype="float64", num_kv_blocks=10, max_model_len=32, max_num_seqs=4)
    results, _ = run(small)
    assert small.scheduler.num_preemptions > 0
    assert {rid: len(tokens) for rid, tokens in results.items()} == {rid: m for rid, _, m, _ in workload}
    assert small.kv_cache.num_free_blocks == 10 and small.kv_cache_usage() == 0.0
    big = make_engine(model_dir, dtype="float64", num_kv_blocks=200, max_model_len=32, max_num_seqs=4)
    reference, _ = run(big)
    assert big.scheduler.num_preemptions == 0
    assert results == reference  # preempted requests recompute to the same greedy tokens
