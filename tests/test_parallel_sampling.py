"""SamplingParams.n > 1: n completions of one prompt, fanned out into child requests that share the prompt's KV
blocks through the prefix cache (engine/group.py); seeds, greedy, output kinds, abort, preemption, the server."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from conftest import build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, LLMEngine, SamplingParams
from mini_infer.sampling_params import RequestOutputKind

PROMPT = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]  # 22 tokens: 5 full blocks of 4
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = build_hf_model(seed=21, vocab_size=300)
    return model, save_hf_model(model, tmp_path_factory.mktemp("n-model"))


def alone(path, prompt, params, **engine_args):
    return LLM(str(path), dtype="float64", block_size=4, **engine_args).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_seeded_completion_equals_its_seed_run_alone(model_dir, prefix_caching):
    _, path = model_dir
    llm = LLM(str(path), dtype="float64", block_size=4, enable_prefix_caching=prefix_caching)
    [out] = llm.generate([PROMPT], replace(SAMPLED, n=4), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    expected = [alone(path, PROMPT, replace(SAMPLED, seed=7 + i)) for i in range(4)]
    assert [c.token_ids for c in out.outputs] == expected
    assert len({tuple(t) for t in expected}) > 1  # the seeds do differ
    assert llm.engine.kv_cache_usage() == 0.0 and not llm.engine.groups


def test_greedy_n2_gives_two_identical_hf_sequences_and_shares_the_prompt_blocks(model_dir):
    model, path = model_dir
    llm = LLM(str(path), dtype="float64", block_size=4)
    kv = llm.engine.kv_cache
    queries, hits = kv.prefix_queries, kv.prefix_hits
    [out] = llm.generate([PROMPT], replace(GREEDY, n=3), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [hf_greedy(model, PROMPT, 10)] * 3
    # The two later children found the first one's 5 full prompt blocks cached: 20 of their 22 prompt tokens.
    assert kv.prefix_queries - queries == 3 * 22 and kv.prefix_hits - hits == 2 * 20
    assert kv.num_free_blocks == kv.num_blocks


def test_mixed_batch_with_preemption(model_dir):
    model, path = model_dir
    other = list(range(30, 60))
    llm = LLM(str(path), dtype="float64", block_size=4, num_kv_blocks=24)
    outs = llm.generate([PROMPT, other, PROMPT], [replace(SAMPLED, n=3), GREEDY, replace(GREEDY, n=2)],
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in outs[0].outputs] == [alone(path, PROMPT, replace(SAMPLED, seed=7 + i))
                                                      for i in range(3)]
    assert outs[1].outputs[0].token_ids == hf_greedy(model, other, 10)
    assert [c.token_ids for c in outs[2].outputs] == [hf_greedy(model, PROMPT, 10)] * 2
    assert llm.engine.kv_cache.num_free_blocks == 24


@pytest.mark.parametrize("chunked", [False, True])
def test_preemption_takes_the_whole_group(model_dir, chunked):
    """Whenever a completion is preempted, every sibling running at that step goes with it in the same step (and
    out of that step's plan); the tokens stay those of each seed run alone."""
    model, path = model_dir
    other = list(range(30, 60))
    llm = LLM(str(path), dtype="float64", block_size=4, num_kv_blocks=24, enable_chunked_prefill=chunked,
              **(dict(max_num_batched_tokens=16) if chunked else {}))
    scheduler = llm.engine.scheduler
    schedule, steps = scheduler.schedule, []

    def recorded(**kwargs):
        running = {r.request_id: r.group_id for r in scheduler.running}
        plan = schedule(**kwargs)
        steps.append((running, plan))
        return plan

    scheduler.schedule = recorded
    outs = llm.generate([PROMPT, other, PROMPT], [replace(SAMPLED, n=3), GREEDY, replace(SAMPLED, n=2, seed=3)],
                        use_tqdm=False)
    grouped = 0
    for running, plan in steps:
        preempted = set(plan.preempted_ids)
        assert not preempted & set(plan.request_ids)  # nothing preempted is computed in the step
        for rid in preempted:
            group = running.get(rid)
            if group is not None:
                grouped += 1
                assert {r for r, g in running.items() if g == group} <= preempted, (rid, running, preempted)
    assert grouped > 1  # groups were preempted (with more than one member)
    assert [c.token_ids for c in outs[0].outputs] == [alone(path, PROMPT, replace(SAMPLED, seed=7 + i))
                                                      for i in range(3)]
    assert outs[1].outputs[0].token_ids == hf_greedy(model, other, 10)
    assert [c.token_ids for c in outs[2].outputs] == [alone(path, PROMPT, replace(SAMPLED, seed=3 + i))
                                                      for i in range(2)]
    assert llm.engine.kv_cache.num_free_blocks == 24


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_output_kinds_carry_every_completion_by_index(model_dir, kind):
    _, path = model_dir
    engine = LLMEngine.from_args(str(path), dtype="float64", block_size=4)
    engine.add_request("g", PROMPT, replace(SAMPLED, n=3, output_kind=kind))
    tokens: dict[int, list[int]] = {}
    outputs = list(engine.run_until_done())
    assert all(o.request_id == "g" for o in outputs) and outputs[-1].finished
    assert not any(o.finished for o in outputs[:-1])
    for output in outputs:
        for completion in output.outputs:
            if kind is RequestOutputKind.DELTA:
                tokens.setdefault(completion.index, []).extend(completion.token_ids)
            else:
                tokens[completion.index] = completion.token_ids
    assert [tokens[i] for i in range(3)] == [alone(path, PROMPT, replace(SAMPLED, seed=7 + i)) for i in range(3)]


def test_abort_takes_the_whole_group_and_frees_its_blocks(model_dir):
    _, path = model_dir
    engine = LLMEngine.from_args(str(path), dtype="float64", block_size=4)
    engine.add_request("g", PROMPT, replace(SAMPLED, n=4, max_tokens=50))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g#2", PROMPT, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("g")
    [output] = engine.step()
    assert output.request_id == "g" and output.finished
    assert sorted(c.index for c in output.outputs) == [0, 1, 2, 3]
    assert {c.finish_reason for c in output.outputs} == {"abort"}
    assert engine.kv_cache_usage() == 0.0 and not engine.groups and not engine.requests
    assert not engine.has_unfinished_requests()


def test_server_n_choices_streamed_and_whole(model_dir):
    from test_server import ServerThread

    from mini_infer.engine.async_engine import AsyncLLMEngine
    from mini_infer.engine.metrics import EngineMetrics
    from mini_infer.entrypoints.openai.api_server import build_app

    _, path = model_dir
    engine = AsyncLLMEngine(LLMEngine.from_args(str(path), dtype="float64", block_size=4), EngineMetrics("m"))
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 6, "temperature": 0.9, "top_p": 0.9, "seed": 7,
            "ignore_eos": True}
    try:
        with ServerThread(build_app(engine, "m")) as server:
            whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
            assert whole["usage"]["completion_tokens"] == 18
            texts: dict[int, str] = {}
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            assert texts == {c["index"]: c["text"] for c in whole["choices"]}
        assert engine.engine.kv_cache_usage() == 0.0
    finally:
        engine.shutdown()


def test_data_parallel_replicas_run_whole_groups(model_dir):
    _, path = model_dir
    other = list(range(40, 70))
    llm = LLM(str(path), dtype="float64", block_size=4, data_parallel_size=2)
    try:
        outs = llm.generate([PROMPT, other], replace(SAMPLED, n=3), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip([PROMPT, other], outs):
        assert [c.token_ids for c in out.outputs] == [alone(path, prompt, replace(SAMPLED, seed=7 + i))
                                                      for i in range(3)]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_best_of_returns_the_n_likeliest_of_its_samples(model_dir, logprobs):
    _, path = model_dir
    llm = LLM(str(path), dtype="float64", block_size=4)
    [out] = llm.generate([PROMPT], replace(SAMPLED, n=2, best_of=5, logprobs=logprobs), use_tqdm=False)
    samples = []
    for i in range(5):  # each child alone, with the logprobs that rank it
        [alone_out] = LLM(str(path), dtype="float64", block_size=4).generate(
            [PROMPT], replace(SAMPLED, seed=7 + i, logprobs=0), use_tqdm=False)
        samples.append(alone_out.outputs[0])
    best = sorted(samples, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([c.cumulative_logprob for c in best])
    assert all((c.logprobs is None) == (logprobs is None) for c in out.outputs)
    assert llm.engine.kv_cache_usage() == 0.0 and not llm.engine.groups


def test_best_of_through_the_server_and_its_refusals(model_dir):
    from test_server import ServerThread

    from mini_infer.engine.async_engine import AsyncLLMEngine
    from mini_infer.engine.metrics import EngineMetrics
    from mini_infer.entrypoints.openai.api_server import build_app

    _, path = model_dir
    engine = AsyncLLMEngine(LLMEngine.from_args(str(path), dtype="float64", block_size=4), EngineMetrics("m"))
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.9, "seed": 7, "ignore_eos": True, "best_of": 3}
    try:
        with ServerThread(build_app(engine, "m")) as server:
            whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert whole.status_code == 200 and [c["index"] for c in whole.json()["choices"]] == [0]
            assert whole.json()["usage"]["completion_tokens"] == 5
            for bad in ({**body, "stream": True}, {**body, "n": 4}):
                refused = httpx.post(server.url + "/v1/completions", json=bad, timeout=60)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of", refused.text
        assert engine.engine.kv_cache_usage() == 0.0
    finally:
        engine.shutdown()
