"""The GPU path end to end (the Triton kernels, decode steps replayed from graphs): greedy tokens in float32 equal HF's
in float64 for each request alone, with graphs and eagerly, through batches that pad to a graph's size, preemption,
prefix caching and chunked prefill.

On the CPU the kernels run in Triton's interpreter and the graphs are the stand-in of runner/graphs.py (small
batches and few tokens: the interpreter runs each program in Python); with MINI_INFER_TEST_DEVICE=cuda they run on
the GPU as they serve, with the batch sizes of the GPU issue's acceptance.
"""

from __future__ import annotations

import random

import pytest

from conftest import DEVICE, GPU_KERNELS, build_hf_model, hf_greedy, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.runner.graphs import DecodeGraphs

ON_GPU = DEVICE != "cpu"
BATCHES = [1, 3, 8, 17, 32, 100] if ON_GPU else [1, 3, 17]
NEW_TOKENS = 16 if ON_GPU else 4
MAX_PROMPT = 40 if ON_GPU else 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint, prompts of 1..MAX_PROMPT tokens, HF float64 greedy continuation of each alone)."""
    model = build_hf_model(seed=11, num_key_value_heads=1, tie_word_embeddings=True)
    path = save_hf_model(model, tmp_path_factory.mktemp("gpu-path"))
    rng = random.Random(11)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, MAX_PROMPT))]
               for _ in range(max(BATCHES))]
    return path, model, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def count_replays(llm: LLM, monkeypatch) -> list[int]:
    """A counter of the steps the engine's graphs ran (an eager step is not counted)."""
    replays = [0]
    run = DecodeGraphs.run

    def counted(self, inputs, edit_ids=None):
        hidden = run(self, inputs, edit_ids)
        replays[0] += hidden is not None
        return hidden
    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return replays


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def engine(path, **overrides) -> LLM:
    settings = dict(dtype="float32", block_size=4, device=DEVICE, gpu_kernels=GPU_KERNELS, max_num_seqs=max(BATCHES))
    return LLM(str(path), **{**settings, **overrides})


def test_graphs_and_eager_equal_hf_at_every_batch_size(reference, monkeypatch):
    """Each batch size through a graph of its padded size (3 pads to 4), its steps scheduled ahead (async scheduling:
    their pending input ids filled on the device before the replay), and eagerly, step by step."""
    path, _, prompts, expected = reference
    graphs, eager = engine(path, async_scheduling=True), engine(path, enforce_eager=True, async_scheduling=False)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    replays = count_replays(graphs, monkeypatch)
    for batch in BATCHES:
        before = replays[0]
        assert generate(graphs, prompts[:batch]) == expected[:batch], batch
        assert replays[0] - before >= NEW_TOKENS - 1, batch  # every decode step replayed a graph
        assert generate(eager, prompts[:batch]) == expected[:batch], batch
    assert graphs.engine.kv_cache.num_free_blocks == graphs.engine.kv_cache.num_blocks


def test_batches_past_the_largest_graph_run_eagerly(reference, monkeypatch):
    path, _, prompts, expected = reference
    llm = engine(path, max_num_seqs=4)
    assert llm.engine.runner.graphs.sizes == [1, 2, 4]
    replays = count_replays(llm, monkeypatch)
    # 6 requests, at most 4 running at once: the steps of 4 replay, the prompts' steps run eagerly
    assert generate(llm, prompts[:6]) == expected[:6]
    assert replays[0] > 0


def test_preemption_prefix_caching_and_chunked_prefill_equal_hf(reference, monkeypatch):
    """A cache too small for the batch (preemption by recompute), prompts sharing a prefix (cache hits), and a token
    budget that splits prompts into chunks beside running decodes."""
    path, _, prompts, expected = reference
    shared = prompts[0] * (1 + 6 // len(prompts[0]))  # a prefix of >= 6 tokens, three full blocks
    batch = [shared + p for p in prompts[:3]] + prompts[3:6]
    want = [hf_greedy(reference[1], p, NEW_TOKENS) for p in batch[:3]] + expected[3:6]
    blocks = max(-(-(len(p) + NEW_TOKENS) // 2) for p in batch) + 2  # room for the longest and a little more
    llm = engine(path, block_size=2, num_kv_blocks=blocks, max_num_batched_tokens=8)
    replays = count_replays(llm, monkeypatch)
    assert generate(llm, batch) == want
    assert llm.engine.scheduler.num_preemptions > 0 and replays[0] > 0
    assert llm.engine.kv_cache.prefix_hits > 0
    assert llm.engine.kv_cache.num_free_blocks == blocks


def test_speculative_verify_steps_equal_hf(reference):
    """Verify steps (1 + k tokens a request, over a cached context) through the Triton prefill kernel, the model as
    its own draft (every draft accepted unless float32 rounding parts them): HF's greedy tokens."""
    path, _, prompts, expected = reference
    llm = engine(path, max_num_seqs=3,
                 speculative_config={"model": str(path), "num_speculative_tokens": 3, "adaptive": False})
    assert generate(llm, prompts[:3]) == expected[:3]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("architecture, extra", [
    ("qwen3", dict(head_dim=32)), ("llama", {}),
    ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))])
def test_qwen3_and_llama_equal_hf(architecture, extra, tmp_path):
    """Qwen3's per-head q/k norms in the fused RoPE + KV store kernel; Llama without a QKV bias; a mixture of experts
    (its steps eager: it reads its routing on the host)."""
    model = build_hf_model(seed=5, architecture=architecture, **extra)
    path = save_hf_model(model, tmp_path / architecture)
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (1, 7, MAX_PROMPT)]
    llm = engine(path)
    assert generate(llm, prompts) == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert (llm.engine.runner.graphs is None) == architecture.endswith("moe")


@pytest.mark.skipif(not ON_GPU, reason="bf16 runs on a CUDA device (the interpreter's bf16 arithmetic is not a GPU's)")
def test_bfloat16_graphs_equal_eager_bit_for_bit(reference):
    path, _, prompts, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = [engine(path, dtype="bfloat16", enforce_eager=eager).generate(prompts[:32], params, use_tqdm=False)
            for eager in (False, True)]
    for graphed, eager in zip(*runs):
        assert graphed.outputs[0].token_ids == eager.outputs[0].token_ids
        assert graphed.outputs[0].logprobs == eager.outputs[0].logprobs


def test_gpu_kernels_refused_where_they_cannot_run(reference, monkeypatch):
    path = reference[0]
    with pytest.raises(ValueError, match="gpu_kernels must be one of auto, on, off"):
        engine(path, gpu_kernels="yes")
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match=r"gpu_kernels 'on' runs the Triton kernels on a CUDA device"):
            engine(path)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(ValueError, match="replaces the native CPU kernels"):
            engine(path, cpu_kernels="on")
    with pytest.raises(ValueError, match="cover bfloat16, float16 and float32, not torch.float64"):
        engine(path, dtype="float64", gpu_kernels="on")
