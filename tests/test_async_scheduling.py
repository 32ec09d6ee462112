"""Async scheduling (EngineConfig.async_scheduling, docs/decisions/032): each step is scheduled and launched before
the one before it has been collected, its sampled tokens pending (placeholders the runner fills on the device). On
the CPU a launch runs to its end, but the bookkeeping is the GPU's: greedy tokens equal HF's (float64, each request
alone) for mixed batches with chunked prefill, prefix caching and preemption; seeded samples, logprobs and stop
tokens equal the synchronous engine's (batch-invariant mode); aborts and requests that finish while the next step
runs lose nothing; steps that need their tokens first (penalties, grammars) wait for them."""

from __future__ import annotations

import random

import pytest

from conftest import PARITY_CONFIGS, build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.config import EngineConfig
from mini_infer.engine.scheduler import Scheduler
from mini_infer.runner.model_runner import ModelRunner
from mini_infer.sampling_params import StructuredOutputsParams

MAX_TOKENS = [5, 17, 1, 30, 9, 2, 24, 12, 3, 20, 8, 16]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A perturbed model, prompts (some sharing a 20-token prefix), each one's max_tokens, and HF's greedy
    continuation of each alone."""
    model = build_hf_model(seed=7, **PARITY_CONFIGS["untied-gqa"])
    path = save_hf_model(model, tmp_path_factory.mktemp("async"))
    rng = random.Random(3)
    prefix = [rng.randrange(1000) for _ in range(20)]
    prompts = [(prefix if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
               for i in range(len(MAX_TOKENS))]
    return str(path), prompts, [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def counted(monkeypatch) -> dict[str, int]:
    """Counters of the steps scheduled ahead and synchronously, and of the pending input ids the runner filled."""
    counts = {"ahead": 0, "sync": 0, "filled": 0}
    schedule, fill = Scheduler.schedule, ModelRunner._fill_pending

    def scheduled(self, run_ahead=False):
        counts["ahead" if run_ahead else "sync"] += 1
        return schedule(self, run_ahead)

    def filled(self, input_ids, step):
        pending = int((input_ids[: step.num_decodes] < 0).sum())
        fill(self, input_ids, step)
        assert not (input_ids < 0).any(), "a placeholder reached the model"
        counts["filled"] += pending

    monkeypatch.setattr(Scheduler, "schedule", scheduled)
    monkeypatch.setattr(ModelRunner, "_fill_pending", filled)
    return counts


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[: len(prompts)]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("blocks, budget", [(None, 512), (40, 16), (24, 8)])
def test_greedy_tokens_equal_hf_with_chunks_prefix_hits_and_preemption(reference, monkeypatch, blocks, budget):
    """The whole cache, then small ones that preempt (the step that preempts waits for the one before it: a pending
    token is never preempted), at chunk budgets that split the prompts; a second wave finds the shared prefix."""
    path, prompts, expected = reference
    counts = counted(monkeypatch)
    llm = LLM(path, dtype="float64", block_size=4, max_num_seqs=8, num_kv_blocks=blocks,
              max_num_batched_tokens=budget, async_scheduling=True)
    assert greedy(llm, prompts) == expected
    assert greedy(llm, prompts) == expected
    assert counts["ahead"] > counts["sync"] and counts["filled"] > 0
    assert llm.engine.kv_cache.prefix_hits > 0
    if blocks == 24:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_seeded_samples_logprobs_and_stops_equal_the_synchronous_engines(reference):
    """Sampled requests with seeds (n > 1 among them), logprobs and stop token ids: the same outputs with steps
    scheduled ahead as without, though a request that stops has its next step computed (and dropped). In batch-
    invariant mode (deterministic): steps ahead change which rows share a step, which plain mode's draws may see."""
    path, prompts, _ = reference

    def run(async_scheduling: bool, stops: list[list[int]]):
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=n, logprobs=2 if i % 2 else None,
                                 stop_token_ids=stop, n=2 if i % 4 == 0 else 1, ignore_eos=True)
                  for i, (n, stop) in enumerate(zip(MAX_TOKENS, stops))]
        llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                  deterministic=True, async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
        return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outputs]

    # Every other request stops at its third token of a first run (the same draws come again: seeds, batch-invariant)
    first = run(False, [[]] * len(prompts))
    stops = [[o[0][0][2]] if i % 2 == 0 and len(o[0][0]) > 3 else [] for i, o in enumerate(first)]
    synchronous = run(False, stops)
    assert run(True, stops) == synchronous
    assert sum(c[1] == "stop" for o in synchronous for c in o) >= 3  # (stops fell mid-run: the test covers them)


def test_an_abort_while_its_step_runs_loses_nothing_else(reference):
    """A request aborted between steps, while its step (scheduled ahead) still runs, reports its abort; the others
    finish with HF's tokens; every block returns."""
    path, prompts, expected = reference
    llm = LLM(path, dtype="float64", block_size=4, max_num_seqs=8, async_scheduling=True)
    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(prompts[:6], MAX_TOKENS)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    finished = {}

    def step():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]

    for _ in range(3):
        step()
    assert engine._in_flight is not None and "3" not in finished
    engine.abort_request("3")
    while engine.has_unfinished_requests():
        step()
    assert finished.pop("3").finish_reason == "abort"
    assert {rid: out.token_ids for rid, out in finished.items()} == {
        str(i): expected[i] for i in range(6) if i != 3}
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("constraint", ["penalties", "grammar"])
def test_steps_that_need_the_tokens_before_them_wait_for_them(reference, tiny_model_dir, monkeypatch, constraint):
    """With a penalised or constrained request unfinished, no step is scheduled ahead; its outputs are the synchronous
    engine's. (A grammar needs a tokenizer: the tiny preset's.)"""
    if constraint == "penalties":
        path, prompts, extra = reference[0], reference[1][:2], dict(repetition_penalty=1.3)
    else:
        path, prompts = str(tiny_model_dir), ["one two", "three"]
        extra = dict(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **extra)]

    def run(async_scheduling: bool):
        llm = LLM(path, dtype="float32", async_scheduling=async_scheduling)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    synchronous = run(False)
    counts = counted(monkeypatch)
    assert run(True) == synchronous
    assert counts["ahead"] == 0 and counts["filled"] == 0 and counts["sync"] > 0


def test_async_scheduling_is_refused_where_it_cannot_run_and_off_by_default_on_the_cpu(reference):
    path, _, _ = reference
    assert not EngineConfig(model=path).runs_ahead
    assert EngineConfig(model=path, async_scheduling=True).runs_ahead
    for kwargs, named in [(dict(tensor_parallel_size=2), "tensor or pipeline parallel"),
                          (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 2}), "speculative decoding"),
                          (dict(async_scheduling="yes"), "true, false or None")]:
        with pytest.raises(ValueError, match="async_scheduling") as error:
            EngineConfig(model=path, **{"async_scheduling": True, **kwargs})
        assert named in str(error.value)
