"""Deterministic mode (EngineConfig.deterministic): a request's tokens and logprobs, greedy or seeded, are the same
bit for bit alone or in any batch, under preemption, at any chunk budget, with a prefix-cache hit or miss, with n > 1.
The parts: one matmul arithmetic per weight shape (kernels/autotune.one_arithmetic), every query through the decode
attention kernel (AttentionMetadata.token_rows), the sampler's fixed-width draw (Sampler(invariant=True))."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_infer import LLM, SamplingParams
from mini_infer.config import EngineConfig
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels import cpu, fused
from mini_infer.kernels.autotune import BUCKETS, one_arithmetic
from mini_infer.runner.sampler import CANDIDATES, Sampler

from test_sampler import BatchSampler, make_request

pytestmark = pytest.mark.skipif(cpu.unavailable_reason() is not None,
                                reason=f"deterministic mode runs on the native kernels: {cpu.unavailable_reason()}")

# Prompts on shared stems (prefix-cache hits), greedy and seeded rows of every draw kind, logprobs, and a seeded n=2.
STEMS = ([9707, 11, 1879, 0, 374, 264, 1273, 13], [785, 3974, 13876, 38835, 34208, 916, 279, 15678])
POOL = [
    ({"prompt_token_ids": STEMS[0] + [100, 200]}, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)),
    ({"prompt_token_ids": STEMS[0] + [300]}, SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=12,
                                                            logprobs=2)),
    ({"prompt_token_ids": STEMS[1] + [7, 8, 9]}, SamplingParams(temperature=0.8, top_k=5, seed=2, max_tokens=10)),
    ({"prompt_token_ids": STEMS[1]}, SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=12, logprobs=1)),
    ({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=1.0, seed=4, max_tokens=12)),
    ({"prompt_token_ids": STEMS[0] + STEMS[1]}, SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=5,
                                                               max_tokens=10, logprobs=3)),
    ({"prompt_token_ids": STEMS[1] + [11]}, SamplingParams(temperature=0.9, seed=6, n=2, max_tokens=12, logprobs=1)),
    ({"prompt_token_ids": list(range(1000, 1030))}, SamplingParams(temperature=0.0, max_tokens=10)),
]
ROOMY = dict(block_size=4, num_kv_blocks=256, max_model_len=96)


def answers(outputs) -> list[tuple]:
    """Per request, per completion: its tokens and each token's logprobs (as they are: compared bit for bit)."""
    return [tuple((tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                               for step in (c.logprobs or []))) for c in o.outputs) for o in outputs]


def alone(llm: LLM) -> list[tuple]:
    return [answers(llm.generate(prompt, params, use_tqdm=False))[0] for prompt, params in POOL]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tiny_model_dir, tmp_path_factory):
    """(model directory, dtype, each pool request's answer alone on a roomy cache)."""
    if request.param == "float32":
        path = tiny_model_dir
    else:
        from mini_infer.factory import make_model

        path = make_model("tiny", tmp_path_factory.mktemp("tiny-bf16") / "model", seed=0, dtype="bfloat16")
    llm = LLM(str(path), dtype=request.param, deterministic=True, **ROOMY)
    return str(path), request.param, alone(llm)


def generate_all(model_dir: str, dtype: str, **engine_args) -> tuple[list[tuple], LLM]:
    llm = LLM(model_dir, dtype=dtype, deterministic=True, **{**ROOMY, **engine_args})
    return answers(llm.generate([p for p, _ in POOL], [s for _, s in POOL], use_tqdm=False)), llm


def test_a_mixed_batch_gives_each_request_its_answer_alone(model):
    model_dir, dtype, reference = model
    together, _ = generate_all(model_dir, dtype)
    assert together == reference


def test_preemption_and_small_chunks_change_nothing(model):
    model_dir, dtype, reference = model
    together, llm = generate_all(model_dir, dtype, num_kv_blocks=12, max_num_batched_tokens=5)
    assert llm.engine.stats().num_preemptions > 0  # the cache really was too small for the batch
    assert together == reference


def test_a_prefix_cache_hit_changes_nothing(model):
    model_dir, dtype, reference = model
    first, llm = generate_all(model_dir, dtype, max_num_batched_tokens=7)
    hits = llm.engine.stats().prefix_hits
    second = answers(llm.generate([p for p, _ in POOL], [s for _, s in POOL], use_tqdm=False))
    assert llm.engine.stats().prefix_hits > hits  # the second pass found the prompts cached
    assert first == second == reference


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_any_batch_budget_and_preemption_point_gives_the_answer_alone(model, data):
    """Requests of the pool arrive in a drawn order at drawn steps, on a drawn cache size and chunk budget (which
    decide who is preempted, when, and how prompts are cut): each still gets its answer alone."""
    model_dir, dtype, reference = model
    picked = data.draw(st.lists(st.sampled_from(range(len(POOL))), min_size=2, max_size=6, unique=True))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 12), min_size=len(picked), max_size=len(picked))))
    engine = LLMEngine.from_args(model_dir, dtype=dtype, deterministic=True, block_size=4, max_model_len=96,
                                 num_kv_blocks=data.draw(st.integers(10, 30)),
                                 max_num_batched_tokens=data.draw(st.integers(3, 40)))
    outputs, step = {}, 0
    while len(outputs) < len(picked):
        for index, arrival in zip(picked, arrivals):
            if arrival == step:
                engine.add_request(str(index), *POOL[index])
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = answers([output])[0]
        step += 1
    assert outputs == {index: reference[index] for index in picked}


# ---- the parts ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paths_of_one_arithmetic_agree_at_every_row_count(dtype):
    """Deterministic mode lets the autotuner pick any path of the shape's arithmetic per bucket: those paths must give
    the same numbers, each row the same in a matmul of any row count."""
    paths = [path for path, why in cpu.matmul_paths(dtype).items() if why is None]
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 96, generator=gen).to(dtype), torch.randn(200, generator=gen).to(dtype)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    by_arithmetic: dict[str, torch.Tensor] = {}
    for path in paths:
        packed = cpu.pack_weight(weight, cpu.weight_layout(path, dtype))
        full = cpu.linear(x, packed, bias, path)
        for rows in (1, 2, 3, 7, 8, 17):
            assert torch.equal(cpu.linear(x[5:5 + rows], packed, bias, path), full[5:5 + rows]), (path, rows)
        first = by_arithmetic.setdefault(cpu.MATMUL_PATHS[path].arithmetic, full)
        assert torch.equal(full, first), path


def test_one_arithmetic_takes_the_cheapest_kind_then_its_fastest_path_per_bucket():
    kinds = {"a1": "a", "a2": "a", "b": "b"}
    # "b" wins 3 buckets by a little, "a" the others by a lot: "a" costs less overall.
    medians = [{"a1": 1.0, "a2": 1.5, "b": 0.9}] * 3 + [{"a1": 2.0, "a2": 1.0, "b": 3.0}] * (len(BUCKETS) - 3)
    assert one_arithmetic(medians, kinds.get) == ["a1"] * 3 + ["a2"] * (len(BUCKETS) - 3)
    assert one_arithmetic([{"a1": 5.0, "a2": 5.0, "b": 1.0}] * len(BUCKETS), kinds.get) == ["b"] * len(BUCKETS)


def test_the_invariant_sampler_draws_a_row_alike_in_any_batch():
    """A seeded row's token and logprobs with neighbours of other kinds and widths (a top_k of 2 or of CANDIDATES,
    a nucleus, greedy) equal its draw alone."""
    vocab = 3 * CANDIDATES
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2

    def run(batch: list[SamplingParams], target: int) -> list[tuple]:
        sampler = BatchSampler(vocab, torch.device("cpu"), seed=0)
        sampler.sampler = Sampler(vocab, torch.device("cpu"), 0, top_k=fused.top_k, invariant=True)
        rows = [make_request(p, request_id=str(i)) for i, p in enumerate(batch)]
        drawn = []
        for _ in range(12):
            out = sampler(logits.expand(len(rows), -1).clone(), rows)
            drawn.append((out.token_ids[target], out.logprobs[target]))
        return drawn

    neighbours = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2, seed=8),
                  SamplingParams(temperature=1.2, top_k=CANDIDATES), SamplingParams(temperature=0.7, top_p=0.5),
                  SamplingParams(temperature=1.0, logprobs=5, logit_bias={3: 2.0})]
    for target in (SamplingParams(temperature=0.9, top_p=0.9, seed=1, logprobs=2),
                   SamplingParams(temperature=0.8, top_k=7, seed=2, logprobs=1),
                   SamplingParams(temperature=1.0, min_p=0.02, seed=3, logprobs=0)):
        reference = run([target], 0)
        assert len({token for token, _ in reference}) > 2  # it really samples
        for batch, index in ((neighbours + [target], len(neighbours)), ([target] + neighbours[1:3], 0),
                             (neighbours[2:] + [target] + neighbours[:2], 3)):
            assert run(batch, index) == reference


@pytest.mark.parametrize("engine_args, message", [
    (dict(dtype="float64"), "deterministic runs bfloat16 or float32 models on the CPU"),
    (dict(cpu_kernels="off"), "deterministic needs the native CPU kernels"),
    (dict(device="cuda"), "the GPU kernels are not batch-invariant yet"),
])
def test_deterministic_is_refused_where_it_cannot_hold(tiny_model_dir, engine_args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_model_dir), deterministic=True, **engine_args)

