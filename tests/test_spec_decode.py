"""Speculative decoding: greedy requests give exactly the tokens of speculation off (float64, perturbed models) with
every proposer (n-gram; a draft that is the target itself, so every draft is accepted; a slightly perturbed copy,
so some are; an unrelated draft, so almost none are) in mixed batches with preemption, prefix caching, chunked
prefill, n > 1, max_tokens at the boundary, stop strings, structured outputs, logprobs, penalties, min_tokens
and tensor parallelism;
sampled requests keep the target's distribution (chi-square against the exact law of a tiny vocabulary) and a seeded
request its very tokens; aborts between verify steps leak no block, and no rejected position enters the prefix
cache. Units: verify(), the n-gram lookup, the adaptive policy, the config's errors, KVCacheManager.trim."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import PARITY_CONFIGS, build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.config import EngineConfig
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.speculation import EMA_WEIGHT, PROBE_COST, ROW_WINDOW, DraftCost, DraftPolicy, SpecDecodeStats
from mini_infer.runner.spec_decode import NgramProposer, verify
from mini_infer.speculative_config import VERIFY_ROW_COST

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A perturbed target (hidden config untied-gqa), drafts of it (itself; a copy with a noisy LM head; an unrelated
    one-layer model), mixed prompts (some repeating a phrase, two sharing a 24-token prefix) and HF's greedy
    continuations of each prompt alone."""
    root = tmp_path_factory.mktemp("spec")
    model = build_hf_model(seed=21, **PARITY_CONFIGS["untied-gqa"])
    target = save_hf_model(model, root / "target")
    noisy = build_hf_model(seed=21, **PARITY_CONFIGS["untied-gqa"])
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        noisy.lm_head.weight.add_(0.08 * torch.randn(noisy.lm_head.weight.shape, generator=gen, dtype=torch.float64))
    save_hf_model(noisy, root / "noisy")
    save_hf_model(build_hf_model(seed=5, **{**PARITY_CONFIGS["untied-gqa"], "num_hidden_layers": 1}), root / "other")
    rng = random.Random(8)
    phrase = [rng.randrange(1000) for _ in range(6)]
    shared = [rng.randrange(1000) for _ in range(24)]
    prompts = [phrase * 4, shared + [5, 6], shared + [rng.randrange(1000) for _ in range(9)],
               [rng.randrange(1000) for _ in range(3)], phrase * 2 + [rng.randrange(1000) for _ in range(30)]]
    expected = [hf_greedy(model, p, 20) for p in prompts]
    # (The drafts of the target's own size cost a step a draft: adaptive k would only probe. These tests are about
    # exactness, so they propose k every step.)
    drafts = {"ngram": NGRAM, "self": {"model": str(target), "num_speculative_tokens": 4, "adaptive": False},
              "noisy": {"model": str(root / "noisy"), "num_speculative_tokens": 3, "adaptive": False},
              "other": {"model": str(root / "other"), "num_speculative_tokens": 2, "adaptive": False}}
    return str(target), prompts, expected, drafts


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("proposer", ["ngram", "self", "noisy", "other"])
def test_greedy_tokens_equal_speculation_off_under_preemption_chunks_prefix_cache_and_n(models, proposer):
    path, prompts, expected, drafts = models
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
              for max_tokens, n in ((20, 1), (20, 2), (20, 1), (7, 1), (20, 1))]
    settings = dict(dtype="float64", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24)
    plain = LLM(path, **settings)
    spec = LLM(path, **settings, speculative_config=drafts[proposer])
    want = _tokens(plain.generate(prompts, greedy, use_tqdm=False))
    assert [w[0] for w in want] == [e[: len(w[0])] for e, w in zip(expected, want)]  # the reference is HF's
    assert _tokens(spec.generate(prompts, greedy, use_tqdm=False)) == want
    # and again with the prompts' blocks in the prefix cache
    assert _tokens(spec.generate(prompts, greedy, use_tqdm=False)) == want
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    # the proposer's time has priced the drafts: the estimate left its prior (the draft's weights over the target's)
    assert spec.engine.scheduler.draft_cost.proposer != spec.engine.config.draft_cost_prior
    # and the decode steps have priced the verify rows: steps of several sizes fitted
    assert len({rows for rows, _ in spec.engine.scheduler.draft_cost.steps}) > 1
    if proposer == "self":
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    if proposer == "noisy":
        assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert spec.engine.kv_cache.num_free_blocks == 40


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_logprobs_are_the_targets_and_seeded_and_penalised_samples_the_same_tokens(models, proposer):
    path, prompts, _, drafts = models
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7,
                             logprobs=2),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11),
              # penalties count the drafts before each verified position
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.3),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=3,
                             repetition_penalty=0.7, frequency_penalty=-0.5),
              # min_tokens masks its stop token in the rows before its min_tokens-th output only
              SamplingParams(temperature=0.0, max_tokens=16, min_tokens=7, stop_token_ids=_eighth(path, prompts[1]))]
    prompts = prompts[:3] + [prompts[0], prompts[4], prompts[1]]
    plain = LLM(path, dtype="float64", block_size=4).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(path, dtype="float64", block_size=4, speculative_config=drafts[proposer])
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(spec) == _tokens(plain)
    assert len(spec[-1].outputs[0].token_ids) == 8 and spec[-1].outputs[0].finish_reason == "stop"
    for a, b in zip(spec[:2], plain[:2]):
        for position_a, position_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert position_a.keys() == position_b.keys()
            for token, entry in position_a.items():
                assert entry.rank == position_b[token].rank
                assert entry.logprob == pytest.approx(position_b[token].logprob, abs=1e-9)
    if proposer == "self":
        assert spec_llm.engine.stats().spec_decode.num_accepted_tokens > 0


def _eighth(path: str, prompt: list[int]) -> list[int]:
    """The eighth token of the prompt's greedy continuation (not among the seven before it): as a stop token with
    min_tokens 7 it ends the request there, in a verify step whose first row comes before the 7th output when 4
    drafts a step are all accepted (outputs 1-5, then 6-10)."""
    out = LLM(path, dtype="float64").generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                                       ignore_eos=True), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    assert tokens[7] not in tokens[:7]
    return [tokens[7]]


def test_stop_strings_and_structured_outputs_end_where_speculation_off_ends(tiny_model_dir):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=person, disable_any_whitespace=True)),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e", "a"]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["the end"],
                             include_stop_str_in_output=True)]
    prompts = ["Name: Ann. Name: Ann. Name:", "Repeat: a b c a b c a b", "hello hello hello"]
    plain = LLM(str(tiny_model_dir), dtype="float64").generate(prompts, params, use_tqdm=False)
    spec = LLM(str(tiny_model_dir), dtype="float64", speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 4}).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert [o.outputs[0].finish_reason for o in spec] == [o.outputs[0].finish_reason for o in plain]
    assert json.loads(spec[0].outputs[0].text)["name"] is not None


def test_tensor_parallel_verifies_as_one_rank(models):
    path, prompts, _, drafts = models
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _tokens(LLM(path, dtype="float64", block_size=4).generate(prompts, greedy, use_tqdm=False))
    llm = LLM(path, dtype="float64", block_size=4, tensor_parallel_size=2, speculative_config=drafts["noisy"])
    assert _tokens(llm.generate(prompts, greedy, use_tqdm=False)) == want
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    llm.engine.shutdown()


def test_aborts_between_verify_steps_return_every_block_and_no_rejected_position_is_cached(models):
    path, prompts, _, drafts = models
    llm = LLM(path, dtype="float64", block_size=4, num_kv_blocks=64, speculative_config=drafts["noisy"])
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy)
    for _ in range(6):
        engine.step()
    in_flight = [r.request_id for r in engine.scheduler.running if r.spec_token_ids]
    assert in_flight  # requests with drafts proposed for their next step
    finished = {rid: engine.requests[rid].all_token_ids for rid in in_flight[:2]}
    engine.abort_request(in_flight[:2])
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = prompts[int(output.request_id)] + output.outputs[0].token_ids
    kv = engine.kv_cache
    assert kv.num_free_blocks == 64 and kv.usage() == 0.0
    # Every block in the prefix cache holds a whole block of some request's real tokens (prompt and output).
    stats = engine.stats().spec_decode
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # (rejections happened)
    real = {tuple(tokens[i: i + 4]) for tokens in finished.values() for i in range(0, len(tokens) - 3, 4)}
    cached = [block for block in range(64) if kv.is_cached(block)]
    assert cached and all(kv._key[block][1] in real for block in cached)


def test_sampled_tokens_follow_the_targets_law(tmp_path):
    """4000 unseeded completions of 4 tokens over a 12-token vocabulary, speculating with the target itself as draft
    (proposals are its argmax: accepted at the rate of the argmax's probability): the law of each position and of
    positions 2 and 3 together equals the exact law computed from the model's float64 probabilities (chi-square,
    p > 1e-4)."""
    vocab = 12
    model = build_hf_model(seed=3, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():  # flatter logits: every token likely enough to be counted
        model.lm_head.weight.mul_(0.3)
    path = save_hf_model(model, tmp_path / "m")
    prompt = [1, 2, 3]
    law = _exact_law(model, prompt, vocab, depth=3)
    llm = LLM(str(path), dtype="float64", max_num_seqs=512,
              speculative_config={"model": str(path), "num_speculative_tokens": 2, "adaptive": False})
    outs = llm.generate([prompt] * 4000, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    samples = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in range(3):
        marginal = law.sum(dim=tuple(d for d in range(3) if d != position))
        _chi_square(torch.bincount(samples[:, position], minlength=vocab), marginal)
    pair = law.sum(dim=0).flatten()
    _chi_square(torch.bincount(samples[:, 1] * vocab + samples[:, 2], minlength=vocab * vocab), pair)


def _exact_law(model, prompt: list[int], vocab: int, depth: int) -> torch.Tensor:
    """P(t1, ..., t_depth | prompt) [vocab] * depth, from the model's float64 softmax."""
    law = torch.ones(())
    prefixes = torch.tensor([prompt])
    for _ in range(depth):
        with torch.no_grad():
            probs = torch.softmax(model(prefixes).logits[:, -1, :vocab], dim=-1)
        law = (law.reshape(-1, 1) * probs).reshape(*[vocab] * (prefixes.shape[1] - len(prompt) + 1))
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(prefixes))[:, None]],
                             dim=1)
    return law


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson's test of counts against probabilities; cells expecting under 5 are pooled into one."""
    total = int(counts.sum())
    expected = probs.double() * total
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    assert p_value > 1e-4, (statistic, dof, p_value)


# ---- units ----

def test_verify_keeps_leading_matches_and_one_more():
    # three requests: drafts [5, 6] (sampled 5, 6, 9: both kept, then 9), [7] (sampled 8, 1: none, then 8), none
    tokens = torch.tensor([5, 6, 9, 8, 1, 4])
    assert verify(tokens, [2, 1, 0], [[5, 6], [7], []]) == [3, 1, 1]
    assert verify(torch.tensor([5, 0, 6]), [2], [[5, 6]]) == [2]  # a mismatch stops the run: 6 is not kept


def test_ngram_lookup_takes_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    tokens = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert proposer._lookup(tokens, 3) == [7, 8, 5]  # suffix [2, 3] last occurred before 7
    assert proposer._lookup(torch.tensor([4, 5, 6]), 2) == []
    assert proposer._lookup(torch.tensor([4, 5, 4]), 5) == [5, 4]  # what followed, up to the end


def test_adaptive_policy_stops_proposing_then_probes_with_growing_waits():
    policy = DraftPolicy(max_k=4)
    ks = []
    for _ in range(40):
        k = policy.next_k(0.1)
        ks.append(k)
        policy.observe(k, 0)
    # An even chance at first (0.5^3 >= 0.1 > 0.5^4), halved by each failed step, then 4 steps without drafts.
    assert ks[:8] == [3, 1, 1, 0, 0, 0, 0, 1]
    zeros = [len(run) for run in "".join("x" if k == 0 else "|" for k in ks).split("|") if run]
    assert zeros[:-1] == [4, 8, 16]  # waits between failed probes of one draft double (the last run is cut short)
    policy.observe(1, 1)  # an accepted probe: drafts come back
    assert policy.next_k(0.1) >= 1
    accepting = DraftPolicy(max_k=4)
    accepting.observe(accepting.next_k(0.1), 3)  # all 3 first drafts accepted: the estimate rises to 0.75
    assert accepting.next_k(0.1) == 4
    assert DraftPolicy(max_k=3, adaptive=False).next_k(2.0) == 3


def test_dearer_drafts_are_fewer_and_the_cost_is_learnt_from_the_proposers_time():
    # At an even chance a draft costing 0.37 of a step (a 0.5B draft for a 1.5B target) is worth one draft, one
    # costing 0.12 (for a 7B target) three (0.5^3 >= 0.12 > 0.5^4).
    assert DraftPolicy(max_k=4).next_k(0.37) == 1
    assert DraftPolicy(max_k=4).next_k(0.12) == 3
    # and probes wait longer: at 3 x PROBE_COST, 12 steps before the first, 24 before the next
    dear = DraftPolicy(max_k=4, acceptance=0.0)
    ks = [dear.next_k(3 * PROBE_COST) for _ in range(40)]
    assert [i for i, k in enumerate(ks) if k] == [12, 37]
    cost = DraftCost(0.3)
    assert cost.value(1) == pytest.approx(0.3 + VERIFY_ROW_COST)
    cost.observe(step_seconds=1.0, proposer_seconds=0.5, drafts=0, proposing=0, rows=0)  # nothing proposed: no sample
    assert cost.proposer == 0.3
    # 0.4 s proposing 2 drafts each for 4 requests (2 draft steps) beside 0.6 s of the rest: 0.2 / 0.6 = 1/3.
    cost.observe(step_seconds=1.0, proposer_seconds=0.4, drafts=8, proposing=4, rows=0)
    assert cost.proposer == pytest.approx(0.3 + EMA_WEIGHT * (1 / 3 - 0.3))
    # one request proposing 2 drafts alone in as long a step: the same draft steps, the same price
    alone = DraftCost(1 / 3)
    alone.observe(step_seconds=1.0, proposer_seconds=0.4, drafts=2, proposing=1, rows=1)
    assert alone.proposer == pytest.approx(1 / 3)


def test_a_verify_rows_price_is_fitted_from_the_steps_and_grows_with_the_batch():
    cost = DraftCost(0.0)
    # Steps of 20 ms fixed + 1 ms a row (less the proposer's time): fitted once they vary in rows.
    for rows in (4, 4, 4):
        cost.observe(step_seconds=0.024 + 0.005, proposer_seconds=0.005, drafts=4, proposing=4, rows=rows)
    assert cost.row(4) == VERIFY_ROW_COST  # one size only: the slope is unknown
    for rows in (8, 12, 16, 16):
        cost.observe(step_seconds=0.020 + 0.001 * rows, proposer_seconds=0.0, drafts=0, proposing=0, rows=rows)
    assert cost.row(1) == pytest.approx(1 / 21)
    assert cost.row(16) == pytest.approx(16 / 36)
    # a step with prompt tokens (rows 0) is not fitted, however long
    cost.observe(step_seconds=5.0, proposer_seconds=0.0, drafts=0, proposing=0, rows=0)
    assert cost.row(16) == pytest.approx(16 / 36)
    # the last ROW_WINDOW steps only: the rows' compute grown (10 ms fixed + 2 ms a row)
    for rows in [4, 8, 12, 16] * (ROW_WINDOW // 4):
        cost.observe(step_seconds=0.010 + 0.002 * rows, proposer_seconds=0.0, drafts=0, proposing=0, rows=rows)
    assert cost.row(16) == pytest.approx(32 / 42)
    assert cost.value(16) == pytest.approx(32 / 42 + cost.proposer)
    # so at one request a draft at a 0.5 chance is worth proposing, in a batch of 16 it is not
    assert DraftPolicy(max_k=4).next_k(cost.value(1)) >= 1
    assert DraftPolicy(max_k=4).next_k(cost.value(16)) == 0


def test_spec_stats_add_across_replicas():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record(3, 2)
    b.record(2, 0)
    total = sum([a, b])
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens, total.num_emitted_tokens) == (
        2, 5, 2, 4)
    assert total.accepted_per_position == [1, 1, 0]


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2},
     r"draft model directory \(or GGUF file\) not found"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
])
def test_bad_speculative_configs_are_refused_by_name(models, config, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        EngineConfig(model=models[0], speculative_config=config)


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path):
    other = save_hf_model(build_hf_model(seed=1, vocab_size=500), tmp_path / "v500")
    with pytest.raises(ValueError, match="another vocabulary"):
        EngineConfig(model=models[0], speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_trim_frees_blocks_past_the_tokens_first_in_eviction_order():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=8)
    assert kv.allocate_slots("a", 14)  # 4 blocks
    kept_blocks = kv.block_ids("a")
    assert kv.trim("a", 5) == 2
    assert kv.block_ids("a") == kept_blocks[:2]
    assert kv.free_blocks()[:2] == [kept_blocks[3], kept_blocks[2]]  # garbage first: evicted before cached blocks
    assert kv.num_free_blocks == 6
    assert kv.trim("a", 8) == 2  # nothing past: unchanged


def test_the_cli_flag_reaches_the_engine_config(models):
    import argparse

    from mini_infer.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", models[0], "--speculative-config", json.dumps(NGRAM)])
    spec = EngineArgs.from_cli_args(args).create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 1, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


def test_deterministic_mode_speculates_bit_for_bit_in_bfloat16(tiny_model_dir):
    """Batch-invariant kernels (docs/decisions/023) make a verify row compute what a decode step computes: in
    bfloat16 the outputs equal speculation off's, and the model as its own draft has every draft accepted."""
    prompts = [list(range(1000, 1060)), list(range(2000, 2017)), [5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = LLM(str(tiny_model_dir), dtype="bfloat16", deterministic=True)
    on = LLM(str(tiny_model_dir), dtype="bfloat16", deterministic=True, speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 4, "adaptive": False})
    assert _tokens(on.generate(prompts, greedy, use_tqdm=False)) == _tokens(off.generate(prompts, greedy,
                                                                                          use_tqdm=False))
    stats = on.engine.stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_a_draft_models_lookahead_never_holds_back_an_admission(models):
    """A pool of exactly the blocks a 16-token prompt and its 4 outputs need (block size 4): the lookahead slots of
    a draft model's proposals would not fit beside the admission's spare block, so the request is admitted without
    them (before, it waited for them for ever) and gives speculation off's tokens."""
    path, _, _, drafts = models
    prompt = list(range(100, 116))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(dtype="float64", block_size=4, num_kv_blocks=5, max_num_seqs=1)
    want = _tokens(LLM(path, **settings).generate([prompt], greedy, use_tqdm=False))
    engine = LLM(path, **settings, speculative_config=drafts["self"]).engine
    engine.add_request("a", prompt, greedy)
    outputs = []
    for _ in range(20):  # (a request that cannot be admitted would never finish)
        outputs += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [[o.outputs[0].token_ids] for o in outputs] == want
    assert engine.kv_cache.num_free_blocks == 5


@pytest.mark.parametrize("proposer", ["self", "noisy"])
def test_a_draft_model_computes_no_position_twice_where_its_drafts_were_kept(models, proposer):
    """The draft model's K/V of the drafts the target accepts stay valid (within the block of the request's last
    token: here all its tokens fit one block): after a verify step it computes only the tokens past them, so where
    every draft is accepted (the target as its draft) no position is computed twice, and where some are rejected
    only theirs are (before, every accepted draft was computed again)."""
    path, prompts, _, drafts = models
    prompt = prompts[3]  # 3 tokens: with 12 more, all in the first block of 16
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _tokens(LLM(path, dtype="float64", block_size=16).generate([prompt], greedy, use_tqdm=False))
    llm = LLM(path, dtype="float64", block_size=16, speculative_config=drafts[proposer])
    draft = llm.engine.runner.speculator.proposer
    computed: list[int] = []
    forward = draft._forward

    def counting(batch, slots, starts, counts):
        computed.extend(p for start, count in zip(starts, counts) for p in range(start, start + count))
        return forward(batch, slots, starts, counts)

    draft._forward = counting
    assert _tokens(llm.generate([prompt], greedy, use_tqdm=False)) == want
    stats = llm.engine.stats().spec_decode
    again = len(computed) - len(set(computed))  # positions computed more than once
    if proposer == "self":
        assert again == 0 and stats.num_accepted_tokens == stats.num_draft_tokens > 0
    else:
        assert 0 < again <= stats.num_draft_tokens - stats.num_accepted_tokens
