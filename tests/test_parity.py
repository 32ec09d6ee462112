"""mini-infer against HF transformers on random-weight Qwen2 models: logits and greedy tokens.

Each request's tokens must equal HF `generate` on that request alone, in float64 so that rounding cannot
flip a near-tie, whatever the batch, the block size, preemption or requests arriving mid-way.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from conftest import DEVICE, PARITY_CONFIGS, build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.engine.llm_engine import LLMEngine

PROMPT_LENGTHS = [1, 2, 7, 16, 33, 50, 77, 100, 5]
MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(PARITY_CONFIGS))
def reference(request, tmp_path_factory):
    """(checkpoint dir, HF model, prompts, HF greedy continuation of each prompt alone)."""
    model = build_hf_model(seed=len(request.param), **PARITY_CONFIGS[request.param])
    path = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    rng = random.Random(request.param)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    expected = [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]
    return path, model, prompts, expected


def engine_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of one packed prefill step over all prompts."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    scheduled = engine.scheduler.schedule()
    assert scheduled.is_prefill and len(scheduled.request_ids) == len(prompts)
    step = engine.runner.prepare(scheduled)
    logits = engine.runner.forward(replace(step, logits_indices=torch.arange(step.num_tokens)))
    return list(logits.split(scheduled.num_new_tokens))


@pytest.mark.parametrize("dtype,tol,kernels", [("float64", 1e-5, "auto"), ("float32", 1e-3, "off"),
                                               ("float32", 1e-3, "on")])
def test_prefill_logits_match_hf(reference, dtype, tol, kernels):
    path, model, prompts, _ = reference
    if kernels == "on" and DEVICE != "cpu":
        pytest.skip("the native kernels run on the CPU")
    engine = LLMEngine.from_args(str(path), dtype=dtype, block_size=4, device=DEVICE, cpu_kernels=kernels)
    ours = engine_logits(engine, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0]
        assert logits.dtype == getattr(torch, dtype)
        torch.testing.assert_close(logits.cpu().double(), theirs, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_bfloat16_logits_as_close_to_float64_as_hf_bfloat16(reference, kernels):
    """In bfloat16 our logits may stray from the float64 reference only about as far as HF's own bfloat16 run."""
    if kernels == "on" and DEVICE != "cpu":
        pytest.skip("the native kernels run on the CPU")
    path, model, prompts, _ = reference
    engine = LLMEngine.from_args(str(path), dtype="bfloat16", block_size=4, device=DEVICE, cpu_kernels=kernels)
    ours = engine_logits(engine, prompts)
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    our_error, hf_error = [], []
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            exact = model(torch.tensor([prompt])).logits[0]
            hf_error.append((hf_bf16(torch.tensor([prompt])).logits[0].double() - exact).abs().mean())
        our_error.append((logits.cpu().double() - exact).abs().mean())
    assert logits.dtype == torch.bfloat16
    assert sum(our_error) <= 1.25 * sum(hf_error), (sum(our_error), sum(hf_error))


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_float32_decode_logprobs_match_hf(reference, kernels):
    """Every decode step of a mixed batch in float32 (native kernels on and off): the sampled token's and the
    top-5 logprobs equal HF's float64 logprobs on the same token sequence, to 1e-3."""
    if kernels == "on" and DEVICE != "cpu":
        pytest.skip("the native kernels run on the CPU")
    path, model, prompts, _ = reference
    llm = LLM(str(path), dtype="float32", block_size=4, device=DEVICE, cpu_kernels=kernels)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = output.outputs[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        expected = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(completion.logprobs):
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(expected[step, token_id].item(), abs=1e-3)


def test_greedy_batch_equals_hf_alone(reference):
    path, _, prompts, expected = reference
    llm = LLM(str(path), dtype="float64", block_size=4, device=DEVICE)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.kv_cache_usage() == 0.0


def test_greedy_with_preemption_equals_hf(reference):
    path, _, prompts, expected = reference
    # 40 blocks of 4 tokens: the longest request alone needs 33, so the batch cannot all stay resident.
    llm = LLM(str(path), dtype="float64", block_size=4, num_kv_blocks=40, device=DEVICE)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.kv_cache.num_free_blocks == 40


def test_requests_joining_mid_decode_equal_hf(reference):
    path, _, prompts, expected = reference
    engine = LLMEngine.from_args(str(path), dtype="float64", block_size=4, max_num_seqs=4, device=DEVICE)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step, while others decode
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        steps += 1
    assert [results[str(i)] for i in range(len(prompts))] == expected


def test_config_layouts_and_shards_load_identically(tmp_path):
    """Published Qwen2.5 config.json (top-level rope_theta) and transformers 5's (rope_parameters), single file
    and sharded: the same logits to the bit, and those match HF."""
    model = build_hf_model(seed=7, **PARITY_CONFIGS["untied-gqa"])
    paths = [save_hf_model(model, tmp_path / "t5", layout="transformers5"),
             save_hf_model(model, tmp_path / "published", layout="published"),
             save_hf_model(model, tmp_path / "sharded", layout="published", max_shard_size="100KB")]
    assert (paths[2] / "model.safetensors.index.json").is_file()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]]
    engines = [LLMEngine.from_args(str(p), dtype="float64", device=DEVICE) for p in paths]
    first, *others = [engine_logits(engine, prompts) for engine in engines]
    for logits in others:
        assert all(torch.equal(x, y) for x, y in zip(first, logits))
    with torch.no_grad():
        torch.testing.assert_close(first[0].cpu(), model(torch.tensor([prompts[0]])).logits[0], rtol=1e-5, atol=1e-5)


def test_float64_logits_exact_against_full_precision_reference(reference, monkeypatch):
    """HF's RMSNorm normalises in float32 even in a float64 model, which alone explains the ~1e-6 gap above:
    with it computing in float64 too, our logits agree to float64 rounding."""
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm_float64(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_float64)
    path, model, prompts, _ = reference
    ours = engine_logits(LLMEngine.from_args(str(path), dtype="float64", block_size=4, device=DEVICE), prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits.cpu(), theirs, rtol=1e-10, atol=1e-10)


def test_unwritten_cache_slots_never_reach_the_output(reference):
    """The KV cache is allocated uninitialised: poison it with NaN and the tokens must not change."""
    path, _, prompts, expected = reference
    llm = LLM(str(path), dtype="float64", block_size=4, device=DEVICE)
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
