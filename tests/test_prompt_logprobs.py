"""SamplingParams.prompt_logprobs (and the completions endpoint's echo): every prompt token's logprob and the top-N at
its position equal HF's float64 log-softmax, however the prompt is split into chunks or recomputed after preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, LLMEngine, SamplingParams
from mini_infer.sampling_params import RequestOutputKind

PROMPTS = [list(range(3, 40)), [7, 1, 8], [5], list(range(100, 111))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = build_hf_model(seed=31, vocab_size=300)
    return model, save_hf_model(model, tmp_path_factory.mktemp("plp"))


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)


def check(model, prompt, prompt_logprobs, top_n: int) -> None:
    expected = hf_prompt_logprobs(model, prompt)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row = prompt_logprobs[position], expected[position - 1]
        token = prompt[position]
        assert next(iter(entry)) == token  # the prompt token first
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(top_n)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-5)
            if tid != token:
                assert entry[tid].rank == rank


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8),  # prompts split across steps
    dict(num_kv_blocks=14),  # preemption recomputes prompts: no position scored twice
])
def test_prompt_logprobs_equal_hf_and_leave_the_tokens_alone(reference, engine_args):
    model, path = reference
    llm = LLM(str(path), dtype="float64", block_size=4, **engine_args)
    params = [replace(GREEDY, prompt_logprobs=3), GREEDY, replace(GREEDY, prompt_logprobs=0),
              replace(GREEDY, prompt_logprobs=5)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 6) for p in PROMPTS]
    assert outs[1].prompt_logprobs is None
    for prompt, out, n in zip(PROMPTS, outs, [3, None, 0, 5]):
        if n is not None:
            check(model, prompt, out.prompt_logprobs, n)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_prompt_logprobs_skip_the_prefix_cache_and_come_once_in_delta_outputs(reference):
    model, path = reference
    engine = LLMEngine.from_args(str(path), dtype="float64", block_size=4)
    engine.add_request("warm", PROMPTS[0], GREEDY)  # caches the prompt's blocks
    list(engine.run_until_done())
    engine.add_request("a", PROMPTS[0], replace(GREEDY, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA))
    carried = [o.prompt_logprobs for o in engine.run_until_done() if o.prompt_logprobs is not None]
    assert len(carried) == 1
    check(model, PROMPTS[0], carried[0], 2)


def test_n_group_carries_the_first_childs_prompt_logprobs(reference):
    model, path = reference
    llm = LLM(str(path), dtype="float64", block_size=4)
    [out] = llm.generate([PROMPTS[0]], replace(GREEDY, n=3, prompt_logprobs=1), use_tqdm=False)
    assert len(out.outputs) == 3
    check(model, PROMPTS[0], out.prompt_logprobs, 1)
