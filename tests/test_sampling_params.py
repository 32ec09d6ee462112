"""SamplingParams validation (ValueError naming the field), and the engine refusing bad requests alone."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from conftest import build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.sampling_params import MAX_LOGPROBS, RequestOutputKind

INVALID = [
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=-1e-9)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="0.7")),
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=-0.1)),
    ("top_p", dict(top_p=1.0000001)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p="0.9")),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=1.5)),
    ("top_k", dict(top_k=2.0)),
    ("top_k", dict(top_k="5")),
    ("top_k", dict(top_k=True)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.01)),
    ("min_p", dict(min_p=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("presence_penalty", dict(presence_penalty=2.01)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=2.0001)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=4.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", dict(logprobs=2.0)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=1.0)),
    ("best_of", dict(n=3, best_of=2)),
    ("best_of", dict(best_of=129)),
    ("best_of", dict(best_of=2.0)),
    ("n", dict(n=129)),
    ("n", dict(n=0)),
    ("n", dict(n=2.0)),
    ("n", dict(n=True)),
    ("stop_token_ids", dict(stop_token_ids=[3, -1])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=["ok", 5])),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed="7")),
    ("output_kind", dict(output_kind="delta")),
    ("logit_bias", dict(logit_bias={5: 100.5})),
    ("logit_bias", dict(logit_bias={5: -101})),
    ("logit_bias", dict(logit_bias={5: math.nan})),
    ("logit_bias", dict(logit_bias={5: "1"})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"5": 1.0})),
    ("logit_bias", dict(logit_bias={True: 1.0})),
    ("logit_bias", dict(logit_bias=[(5, 1.0)])),
]


def _names(field: str) -> str:
    """A pattern matching the field's name as a whole word."""
    return rf"(?<![A-Za-z_]){re.escape(field)}(?![A-Za-z_])"


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}={list(k.values())[0]!r}" for f, k in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=_names(field)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field,kwargs", [
    ("stop_token_ids", dict(stop_token_ids=5)),  # a bare int instead of a list
    ("stop", dict(stop=5)),
])
def test_wrongly_typed_containers_raise_value_error_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=_names(field)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_that_no_generator_accepts_is_refused_naming_the_field(seed):
    # torch.Generator.manual_seed overflows outside these ranges; the user should hear about `seed`.
    with pytest.raises(ValueError, match=_names("seed")):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=100000),
    dict(top_p=1.0), dict(top_p=1e-9), dict(top_p=1),
    dict(temperature=0), dict(temperature=0.0), dict(temperature=100.0),
    dict(min_p=0.0), dict(min_p=1.0),
    dict(repetition_penalty=1e-6), dict(repetition_penalty=3.0),
    dict(presence_penalty=-2.0), dict(presence_penalty=2), dict(frequency_penalty=-2), dict(frequency_penalty=2.0),
    dict(max_tokens=1), dict(max_tokens=None), dict(max_tokens=None, min_tokens=1000),
    dict(min_tokens=16, max_tokens=16), dict(min_tokens=0),
    dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(logprobs=None),
    dict(stop_token_ids=[0, 151645]), dict(stop_token_ids=[]), dict(stop=[]), dict(stop=" "),
    dict(seed=0), dict(seed=-5), dict(seed=2**63 - 1),
    dict(output_kind=RequestOutputKind.DELTA),
    dict(logit_bias={0: -100, 151935: 100.0, 7: 0.5}),
    dict(n=1), dict(n=2), dict(n=128), dict(prompt_logprobs=0), dict(prompt_logprobs=20),
    dict(best_of=None), dict(n=2, best_of=2), dict(n=2, best_of=128),
])
def test_valid_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert (p.stop_strings, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output) == ([], [], False, False)
    assert not p.greedy and not p.uses_penalties


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(4, 2)).stop_token_ids == [4, 2]


@pytest.mark.parametrize("temperature,greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_means_temperature_below_epsilon(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("kwargs,uses", [
    (dict(), False), (dict(repetition_penalty=1.1), True), (dict(presence_penalty=-0.1), True),
    (dict(frequency_penalty=0.5), True), (dict(repetition_penalty=1.0, presence_penalty=0.0), False),
])
def test_uses_penalties(kwargs, uses):
    assert SamplingParams(**kwargs).uses_penalties is uses


# ---- the engine refuses a bad request and keeps serving the others ----

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    model = build_hf_model(seed=11, vocab_size=300)
    return model, save_hf_model(model, tmp_path_factory.mktemp("params-model"))


def _bad_requests(vocab_size: int, max_model_len: int):
    prompt = [5, 6, 7]
    return [
        ("params-not-samplingparams", prompt, {"temperature": 0.5}, "params"),
        ("too-long", prompt, SamplingParams(max_tokens=max_model_len), "max_tokens"),
        ("prompt-fills-context", list(range(max_model_len)), GREEDY, "max_model_len"),
        ("stop-without-tokenizer", prompt, SamplingParams(stop=["x"]), "stop"),
        ("token-out-of-range", [1, vocab_size], GREEDY, "out of range"),
        ("empty-prompt", [], GREEDY, "empty"),
        ("text-without-tokenizer", "hello", GREEDY, "tokenizer"),
        ("logit-bias-out-of-vocab", prompt, SamplingParams(temperature=0.0, logit_bias={vocab_size: 1.0}),
         "logit_bias token id 300"),
    ]


def test_engine_refuses_bad_requests_and_keeps_serving(hf_model_dir):
    model, path = hf_model_dir
    engine = LLMEngine.from_args(str(path), dtype="float64", block_size=4, max_model_len=64)
    good_prompt = [3, 1, 4, 1, 5]
    engine.add_request("good", good_prompt, GREEDY)
    engine.step()  # the good request is running when the bad ones arrive
    for request_id, prompt, params, message in _bad_requests(300, 64):
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request(request_id, prompt, params)
        assert request_id not in engine.requests
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", good_prompt, GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    assert len(engine.scheduler.waiting) == 0 and len(engine.scheduler.running) == 1

    final = None
    for output in engine.run_until_done():
        assert output.request_id == "good"
        final = output
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == hf_greedy(model, good_prompt, 6)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks

    # A refused id was never registered, so it is free to use.
    engine.add_request("too-long", good_prompt, GREEDY)
    outputs = list(engine.run_until_done())
    assert outputs[-1].request_id == "too-long" and outputs[-1].outputs[0].token_ids == final.outputs[0].token_ids


def test_llm_generate_rejects_a_bad_batch_then_keeps_serving(hf_model_dir):
    model, path = hf_model_dir
    llm = LLM(str(path), dtype="float64", block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1: .*max_tokens"):
        llm.generate([[1, 2, 3], [4, 5, 6]], [GREEDY, SamplingParams(max_tokens=64)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    [out] = llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, [4, 5, 6], 6)


def test_logit_bias_steers_its_request_alone_in_a_batch(hf_model_dir):
    model, path = hf_model_dir
    llm = LLM(str(path), dtype="float64", block_size=4, max_model_len=64)
    plain = [3, 1, 4, 1, 5]
    expected = hf_greedy(model, plain, 6)
    banned = replace(GREEDY, logit_bias={expected[0]: -100.0})
    forced = replace(GREEDY, logit_bias={42: 100.0})
    outs = llm.generate([plain, plain, [9, 8, 7]], [GREEDY, banned, forced], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected
    with torch.no_grad():
        runner_up = model(torch.tensor([plain])).logits[0, -1].topk(2).indices[1].item()
    assert outs[1].outputs[0].token_ids[0] == runner_up != expected[0]
    assert outs[2].outputs[0].token_ids == [42] * 6
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
