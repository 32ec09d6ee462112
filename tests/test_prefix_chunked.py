"""Prefix caching and chunked prefill: greedy parity with HF (float64, each request alone) for shared prefixes,
fully cached prompts, chunk budgets of 3, 16 and 64, both together with forced preemption and aborts; the KV
manager's reference counting, LRU eviction and collision safety, as properties and by hand."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import PARITY_CONFIGS, build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.config import SERVE_TARGET_ITL_MS
from mini_infer.engine import kv_cache as kv_module
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.scheduler import MIN_PROMPT_CHUNK

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A perturbed model, prompts that share a 40-token system prefix (and some a longer one), and HF's greedy
    continuation of each prompt alone."""
    model = build_hf_model(seed=11, **PARITY_CONFIGS["untied-gqa"])
    path = save_hf_model(model, tmp_path_factory.mktemp("prefix"))
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(40)]
    longer = system + [rng.randrange(1000) for _ in range(9)]
    prompts = [system + [rng.randrange(1000) for _ in range(n)] for n in (1, 5, 12, 30)]
    prompts += [longer + [rng.randrange(1000) for _ in range(n)] for n in (3, 17)]
    prompts += [[rng.randrange(1000) for _ in range(n)] for n in (7, 50)]  # unrelated
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    expected.append(hf_greedy(model, prompts[3][:68], MAX_NEW))  # a whole number of blocks of 4
    return str(path), prompts, expected


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("chunked", [True, False])
def test_shared_prefixes_submitted_together_and_in_a_second_wave(shared, chunked):
    path, prompts, expected = shared
    expected = expected[: len(prompts)]
    llm = LLM(path, dtype="float64", block_size=4, enable_chunked_prefill=chunked)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    kv = llm.engine.kv_cache
    first_hits = kv.prefix_hits
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    # The second wave finds every prompt's full blocks but the last cached: at least the shared system prompt.
    wave_hits = kv.prefix_hits - first_hits
    assert wave_hits >= sum(((len(p) - 1) // 4) * 4 for p in prompts) - 4 * len(prompts)
    assert kv.prefix_queries >= 2 * sum(len(p) for p in prompts)
    assert llm.engine.kv_cache_usage() == 0.0


def test_prompt_cached_in_full_recomputes_its_last_block_only(shared):
    path, prompts, expected = shared
    llm = LLM(path, dtype="float64", block_size=4)
    prompt = prompts[3]  # 70 tokens: 17 full blocks and 2 more tokens
    assert tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expected[3]]
    hits = llm.engine.kv_cache.prefix_hits
    assert tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expected[3]]
    # Prompt + 12 generated tokens were cached; the prompt's own 17 full blocks are all hits now.
    assert llm.engine.kv_cache.prefix_hits - hits == 17 * 4
    exact = prompt[:68]  # a multiple of the block size, every block cached: its last block is recomputed
    hits = llm.engine.kv_cache.prefix_hits
    assert tokens(llm.generate([exact], GREEDY, use_tqdm=False)) == [expected[-1]]
    assert llm.engine.kv_cache.prefix_hits - hits == 16 * 4


@pytest.mark.parametrize("budget", [3, 16, 64])
def test_chunked_prefill_budgets_equal_hf(shared, budget):
    path, prompts, expected = shared
    llm = LLM(path, dtype="float64", block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected[: len(prompts)]


def test_chunked_step_never_exceeds_the_budget_and_decodes_come_first(shared):
    path, prompts, _ = shared
    llm = LLM(path, dtype="float64", block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    saw_mixed = False
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        assert scheduled.num_tokens <= 16
        lens = scheduled.num_new_tokens
        requests = [engine.requests[rid] for rid in scheduled.request_ids]
        decodes = [r.num_tokens - r.num_computed_tokens == 1 for r in requests]
        assert decodes == sorted(decodes, reverse=True)  # every decode before every prompt chunk
        saw_mixed |= any(decodes) and not all(decodes)
        engine._outputs(engine.scheduler.update(scheduled, engine.executor.execute(scheduled)))
        assert len(lens) == len(scheduled.request_ids)
    assert saw_mixed


def test_both_features_with_forced_preemption_and_aborts(shared):
    path, prompts, expected = shared
    # 60 blocks of 4: the batch cannot all stay resident, so decodes preempt; chunks of 24 tokens.
    llm = LLM(path, dtype="float64", block_size=4, num_kv_blocks=60, max_num_batched_tokens=24)
    engine = llm.engine
    for wave in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{wave}-{i}", prompt, GREEDY)
        engine.add_request(f"{wave}-doomed", prompts[0] + [1, 2, 3], GREEDY)
        results, steps = {}, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            if steps == 3:
                engine.abort_request(f"{wave}-doomed")
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out.outputs[0]
        assert results[f"{wave}-doomed"].finish_reason == "abort"
        assert [results[f"{wave}-{i}"].token_ids for i in range(len(prompts))] == expected[: len(prompts)]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_hits > 0
    kv = engine.kv_cache
    assert kv.num_free_blocks == 60 and all(kv.ref_count(b) == 0 for b in range(60))


@pytest.mark.parametrize("target_itl_ms", [1e-3, 30.0])
def test_a_step_time_target_leaves_greedy_tokens_equal_hf(shared, target_itl_ms):
    """The step-time target on (its real cost model, learnt from this run's steps), prompts arriving while others
    decode, preemption and prefix hits: every request's tokens are HF's, and at a target no step can keep, a
    decoding step takes one smallest chunk of one prompt once the model has learnt enough."""
    path, prompts, expected = shared
    llm = LLM(path, dtype="float64", block_size=4, num_kv_blocks=30, max_num_batched_tokens=64,
              target_itl_ms=target_itl_ms)
    engine = llm.engine
    results, chunks_while_decoding = {}, []
    for wave in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{wave}-{i}", prompt, GREEDY)
            if i % 2:  # the next prompts arrive while these run
                results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        while engine.has_unfinished_requests():
            plan = engine.scheduler.schedule()
            requests = [engine.requests[rid] for rid in plan.request_ids]
            if any(r.num_computed_tokens >= r.num_prompt_tokens and n == 1
                   for r, n in zip(requests, plan.num_new_tokens)) and engine.scheduler.step_cost.coefficients:
                chunks_while_decoding.append(sum(n for n in plan.num_new_tokens if n > 1))
            update = engine.scheduler.update(plan, engine.executor.execute(plan))
            results.update({o.request_id: o.outputs[0].token_ids for o in engine._outputs(update) if o.finished})
    assert [results[f"{wave}-{i}"] for wave in range(2) for i in range(len(prompts))] == 2 * expected[: len(prompts)]
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.prefix_hits > 0
    assert engine.kv_cache.num_free_blocks == 30
    if target_itl_ms < 1:
        assert chunks_while_decoding and max(chunks_while_decoding) <= MIN_PROMPT_CHUNK


def test_forced_hash_collision_never_reuses_a_block_whose_tokens_differ(shared, monkeypatch):
    """Every block hashes alike: a lookup still only hits a block with these very token ids on this very
    parent, so the outputs stay exact."""
    path, prompts, expected = shared
    monkeypatch.setattr(kv_module, "block_hash", lambda parent, token_ids: 42)
    llm = LLM(path, dtype="float64", block_size=4)
    for _ in range(2):
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected[: len(prompts)]


def test_collision_by_hand(monkeypatch):
    """All blocks hash alike: the stored token ids (and parent) decide, and the newest block owns the entry."""
    monkeypatch.setattr(kv_module, "block_hash", lambda parent, token_ids: 7)
    kv = KVCacheManager(num_blocks=8, block_size=2, max_num_seqs=4, max_blocks_per_seq=4)
    assert kv.allocate_with_prefix("a", [], 2)
    kv.cache_blocks("a", lambda s, e: [1, 2][s:e], 2)  # block 0 holds (1, 2)
    assert kv.match_prefix([1, 2, 9]) == [0]  # same tokens, no parent: a true hit
    assert kv.match_prefix([5, 6, 9]) == []  # same hash, other tokens: no hit
    assert kv.allocate_with_prefix("b", [], 2)
    kv.cache_blocks("b", lambda s, e: [3, 4][s:e], 2)  # block 1 holds (3, 4), same hash: it takes the entry
    assert kv.match_prefix([1, 2, 9]) == [] and kv.match_prefix([3, 4, 9]) == [1]
    assert kv.is_cached(1) and not kv.is_cached(0)
    assert kv.allocate_with_prefix("c", [], 4)
    kv.cache_blocks("c", lambda s, e: [3, 4, 3, 4][s:e], 4)
    # c's first block duplicates block 1 (not registered again); its second, (3, 4) on block 1, takes the entry:
    # a sequence starting (3, 4) now finds an entry whose parent does not fit, so the collision costs a miss.
    assert kv.match_prefix([3, 4, 3, 4, 9]) == []
    assert kv.is_cached(kv.block_ids("c")[1]) and not kv.is_cached(1)


def test_freed_blocks_stay_findable_and_are_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, max_num_seqs=4, max_blocks_per_seq=6)
    seq_a, seq_b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    for rid, seq in (("a", seq_a), ("b", seq_b)):
        assert kv.allocate_with_prefix(rid, kv.match_prefix(seq), 5)
        kv.cache_blocks(rid, lambda s, e, seq=seq: seq[s:e], 5)
    blocks_a, blocks_b = kv.block_ids("a"), kv.block_ids("b")
    kv.free("a")
    kv.free("b")
    assert kv.usage() == 0.0 and kv.num_free_blocks == 6
    # Eviction order: the never-used blocks first, then a's (its last block first), then b's.
    assert kv.free_blocks() == [b for b in range(6) if b not in blocks_a + blocks_b] + blocks_a[::-1] + \
        blocks_b[::-1]
    assert kv.match_prefix(seq_a) == blocks_a[:2] and kv.match_prefix(seq_b) == blocks_b[:2]
    assert kv.allocate_slots("c", 2 * 2)  # takes the 0 never-used blocks... then a's partial and second block
    assert kv.match_prefix(seq_a) == blocks_a[:1] and kv.match_prefix(seq_b) == blocks_b[:2]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests drawn from a few shared prefixes, admitted with their cached prefix, grown, computed (blocks
    registered), finished, aborted or preempted at random; the invariants hold after every step."""

    PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [8, 8, 8, 8, 8]]

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=10, block_size=2, max_num_seqs=4, max_blocks_per_seq=10)
        self.live: dict[str, list[int]] = {}  # request -> its token ids
        self.next_id = 0

    @rule(prefix=st.integers(0, 2), extra=st.lists(st.integers(1, 5), max_size=5))
    def admit(self, prefix, extra):
        seq = self.PREFIXES[prefix] + extra
        rid = f"r{self.next_id}"
        self.next_id += 1
        hits = self.kv.match_prefix(seq)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_with_prefix(rid, hits, len(seq)):
            assert self.kv.block_ids(rid)[: len(hits)] == hits
            self.live[rid] = seq
            self.kv.cache_blocks(rid, lambda s, e, seq=seq: seq[s:e], len(seq))
        else:
            assert self.kv.num_free_blocks == free_before and self.kv.block_ids(rid) == []

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), grow=st.integers(1, 4))
    def decode(self, pick, grow):
        rid = list(self.live)[pick % len(self.live)]
        seq = self.live[rid] + [6] * grow
        if self.kv.allocate_slots(rid, len(seq)):
            self.live[rid] = seq
            self.kv.cache_blocks(rid, lambda s, e, seq=seq: seq[s:e], len(seq))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):  # finish, abort and preemption all drop the request's references
        rid = list(self.live)[pick % len(self.live)]
        self.kv.free(rid)
        del self.live[rid]

    @invariant()
    def references_add_up(self):
        kv = self.kv
        counts = [0] * kv.num_blocks
        for rid in self.live:
            for b in kv.block_ids(rid):
                counts[b] += 1
        assert counts == [kv.ref_count(b) for b in range(kv.num_blocks)]  # never negative, never lost
        free = kv.free_blocks()
        assert len(free) == len(set(free))
        assert all(counts[b] == 0 for b in free), "a block is both free and referenced"
        assert sorted(free + [b for b in range(kv.num_blocks) if counts[b]]) == list(range(kv.num_blocks))
        assert kv.usage() == pytest.approx(1 - len(free) / kv.num_blocks)

    @invariant()
    def hits_hold_the_right_tokens(self):
        for rid, seq in self.live.items():  # a fresh lookup of a live sequence finds blocks holding its tokens
            for i, block in enumerate(self.kv.match_prefix(seq)):
                assert self.kv._key[block][1] == tuple(seq[2 * i: 2 * i + 2])

    def teardown(self):
        for rid in list(self.live):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


@pytest.mark.parametrize("workload, settings", [("shared-prefix", ["caching off", "caching on"]),
                                                 ("long-prompt", ["chunked off", "chunked on",
                                                                  f"on, step target {SERVE_TARGET_ITL_MS:g} ms"])])
def test_feature_workloads_write_table_json_and_chart(tiny_model_dir, tmp_path, capsys, workload, settings):
    import json

    from mini_infer.entrypoints.cli import main

    assert main(["bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--workload", workload,
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / f"{workload}.json").read_text())
    assert list(report["settings"]) == settings
    printed = capsys.readouterr().out
    assert all(name in printed for name in settings)
    if workload == "shared-prefix":
        off, on = report["settings"]["caching off"], report["settings"]["caching on"]
        assert off["prefix_hits"] == 0 and on["prefix_hits"] >= 31 * 512  # all but the first find the prompt
        assert on["prefix_queries"] == off["prefix_queries"] == 32 * (512 + 32) + 4 * 64  # + the warm-up
    else:
        off, on, target = (report["settings"][name] for name in settings)
        assert off["long_prompts_added"] == on["long_prompts_added"] == target["long_prompts_added"] == 4
        # every token of every stream after its first
        assert off["num_gaps"] == on["num_gaps"] == target["num_gaps"] == 8 * 127
        assert (off["target_itl_ms"], on["target_itl_ms"], target["target_itl_ms"]) == (None, None, SERVE_TARGET_ITL_MS)
    assert (tmp_path / f"{workload}.png").read_bytes().startswith(b"\x89PNG")
