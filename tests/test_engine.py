"""LLMEngine and LLM behaviour: bad input fails alone, streaming outputs, aborts, prompt forms."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import build_hf_model, save_hf_model
from mini_infer import LLM, LLMEngine, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A token-ids-only checkpoint (no tokenizer files), vocab 1000, max_model_len 1024."""
    return save_hf_model(build_hf_model(seed=11), tmp_path_factory.mktemp("engine") / "model")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)


def run_to_end(engine: LLMEngine) -> dict[str, object]:
    return {output.request_id: output for output in engine.run_until_done() if output.finished}


@pytest.mark.parametrize("prompt,params,message", [
    ([], GREEDY, "prompt is empty"),
    ([1, 2, 1000], GREEDY, r"token id 1000 is out of range: token ids must be in \[0, 999\]"),
    ([-1], GREEDY, r"token id -1 is out of range"),
    ([1, 2.5], GREEDY, "token ids must be integers"),
    ([1] * 128, GREEDY, r"prompt has 128 tokens; max_model_len is 128"),
    ([1] * 100, SamplingParams(max_tokens=29), r"prompt \(100 tokens\) \+ max_tokens \(29\) = 129 exceeds "
                                               r"max_model_len \(128\)"),
    ("some text", GREEDY, "no tokenizer.json; pass token ids"),
    (12, GREEDY, "prompt must be a string, a list of token ids or a dict"),
    ({"text": "x"}, GREEDY, "'prompt' or a 'prompt_token_ids' key"),
    ([1, 2], "not params", "params must be a SamplingParams"),
])
def test_bad_requests_fail_alone_and_the_engine_keeps_serving(llm, prompt, params, message):
    engine = llm.engine
    engine.add_request("good-before", [5, 6, 7], GREEDY)
    engine.step()  # the good request is running when the bad one arrives
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-after", [8, 9], GREEDY)
    final = run_to_end(engine)
    assert set(final) == {"good-before", "good-after"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in final.values())
    assert engine.kv_cache_usage() == 0.0 and engine.kv_cache.num_free_blocks == 64


def test_request_needing_more_blocks_than_the_cache_is_rejected(model_dir):
    engine = LLMEngine.from_args(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=8, max_model_len=128)
    with pytest.raises(ValueError, match=r"needs 9 KV blocks but the whole cache has 8 \(block_size 4\)"):
        engine.add_request("big", [1] * 30, SamplingParams(max_tokens=4))
    engine.add_request("fits", [1] * 28, SamplingParams(max_tokens=4, ignore_eos=True))
    assert run_to_end(engine)["fits"].outputs[0].finish_reason == "length"


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("same", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        engine.add_request("same", [3], GREEDY)
    run_to_end(engine)
    engine.add_request("same", [3], GREEDY)  # free again once finished
    run_to_end(engine)


def test_a_bad_prompt_in_a_generate_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match=r"prompt 2: prompt token id 5000 is out of range"):
        llm.generate([[1, 2], [3], [5000], [4]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_usage() == 0.0
    outputs = llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


def test_generate_keeps_input_order_and_per_prompt_params(llm):
    prompts = [[7] * n for n in (30, 1, 12, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 9, 1, 6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 6]
    assert all(o.finished and o.prompt is None and o.outputs[0].text == "" for o in outputs)
    # A single token-id prompt and a dict prompt are accepted too.
    single = llm.generate([7, 7, 7], GREEDY, use_tqdm=False)
    as_dict = llm.generate({"prompt_token_ids": [7, 7, 7]}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == as_dict[0].outputs[0].token_ids


def test_step_streams_cumulative_and_delta_outputs(llm):
    engine = llm.engine
    engine.add_request("cumulative", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.add_request("delta", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA))
    engine.add_request("final", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                          output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"cumulative": [], "delta": [], "final": []}
    for output in engine.run_until_done():
        seen[output.request_id].append(output)
    cumulative = [o.outputs[0].token_ids for o in seen["cumulative"]]
    assert [len(c) for c in cumulative] == [1, 2, 3, 4, 5]
    assert [len(o.outputs[0].token_ids) for o in seen["delta"]] == [1] * 5
    assert [t for o in seen["delta"] for t in o.outputs[0].token_ids] == cumulative[-1]
    assert len(seen["final"]) == 1 and seen["final"][0].outputs[0].token_ids == cumulative[-1]
    assert [o.finished for o in seen["cumulative"]] == [False] * 4 + [True]


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("running", [1] * 20, long)
    engine.add_request("other", [2] * 10, long)
    engine.step()
    engine.step()
    used = engine.kv_cache.num_free_blocks
    engine.abort_request("running")
    assert engine.kv_cache.num_free_blocks == used + 6  # 20 prompt + 2 tokens = 22 -> 6 blocks of 4
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["running"].finished and outputs["running"].outputs[0].finish_reason == "abort"
    assert len(outputs["running"].outputs[0].token_ids) == 2
    engine.abort_request(["other", "unknown-id"])
    assert engine.step()[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.kv_cache_usage() == 0.0


def test_kv_cache_usage_grows_and_returns_to_zero(llm):
    engine = llm.engine
    assert engine.kv_cache_usage() == 0.0
    engine.add_request("a", [1] * 16, GREEDY)
    engine.step()  # prefill: 16 prompt tokens in 4 blocks
    assert engine.kv_cache_usage() == 4 / 64
    engine.step()  # decode: the 17th token opens a fifth block
    assert engine.kv_cache_usage() == 5 / 64
    run_to_end(engine)
    assert engine.kv_cache_usage() == 0.0


def test_default_sampling_params_come_from_generation_config(model_dir, tmp_path):
    path = shutil.copytree(model_dir, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1, "eos_token_id": [3, 4]}))
    llm = LLM(str(path), dtype="float32")
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.1)
    assert {3, 4} <= llm.engine.processor.eos_token_ids
