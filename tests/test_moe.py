"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE) on the decoder: float64 parity with HF's Qwen2MoeForCausalLM /
Qwen3MoeForCausalLM (router softmax in float32, top-k renormalised or not, shared experts and their gate, dense
layers among sparse ones by decoder_sparse_step and mlp_only_layers) in mixed batches under preemption, prefix
caching and chunked prefill, and under tensor parallelism; the experts' grouping (each expert with tokens runs
once a step, the others not at all); quantised experts; the presets; what is refused."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import (DEVICE, FAMILY_NEW_TOKENS, build_hf_model, check_preemption_prefix_caching_and_chunks,
                      family_checkpoint, hf_greedy, prefill_logits, rms_norm_float64, save_hf_model)
from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels import quant
from mini_infer.model.moe import SparseMoeBlock, swiglu_mlps
from mini_infer.model.ops import TunedWeight

# name -> (HF architecture, config)
CONFIGS = {
    # Qwen3-30B-A3B-like: every layer sparse, top 2 of 8 renormalised, head_dim 16 of its own, tied head
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, tie_word_embeddings=True)),
    # Qwen1.5-MoE-like: a shared expert and its gate, top 3 of 6 not renormalised, Qwen2's QKV biases; of 4 layers
    # the odd ones sparse (decoder_sparse_step 2) bar layer 3 (mlp_only_layers)
    "qwen2-moe": ("qwen2_moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                    num_experts_per_tok=3, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=4)),
}
MAX_NEW_TOKENS = FAMILY_NEW_TOKENS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe(request, tmp_path_factory):
    """(checkpoint dir, HF model, prompts, HF greedy continuation of each prompt alone)."""
    architecture, config = CONFIGS[request.param]
    return family_checkpoint(request.param, architecture, config, tmp_path_factory.mktemp(request.param))


def test_config_reads_the_mixture(moe):
    path, model, _, _ = moe
    config = ModelConfig.from_dir(path)
    hf = model.config
    assert config.architecture == type(model).__name__
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size, config.moe.norm_topk_prob) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob)
    assert config.moe.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)
    # which layers are sparse: HF's own decision, layer by layer
    assert [config.sparse(i) for i in range(hf.num_hidden_layers)] == [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert config.attention_bias == (hf.model_type == "qwen2_moe") and config.qk_norm == (hf.model_type == "qwen3_moe")


def test_decode_weights_count_the_experts_a_token_reads():
    """A decode step of one token reads the router and its top_k experts of each sparse layer, not every expert."""
    architecture, settings = CONFIGS["qwen2-moe"]
    config = ModelConfig.from_dict({**build_hf_model(architecture=architecture, **settings).config.to_dict(),
                                    "architectures": ["Qwen2MoeForCausalLM"]})
    hidden, attention = 64, 64 * (2 * 64 + 2 * 32)
    dense, sparse = 3 * hidden * config.intermediate_size, (6 * hidden + 3 * 3 * hidden * 24 + 3 * hidden * 48
                                                            + hidden)
    assert config.decode_weights == 4 * attention + 3 * dense + sparse + 1000 * hidden  # layer 1 only is sparse


def test_float64_logits_exact_against_full_precision_reference(moe, monkeypatch):
    """With HF's RMSNorm computing in float64 too, our prefill logits agree with HF's to float64 rounding: the
    router's float32 softmax and top-k, the experts, the shared expert and its gate, the dense layers between."""
    path, model, prompts, _ = moe
    monkeypatch.setattr(type(model.model.norm), "forward", rms_norm_float64)
    engine = LLMEngine.from_args(str(path), dtype="float64", device=DEVICE)
    for prompt in prompts[2:5]:
        ours = prefill_logits(engine, prompt)
        engine.abort_request("p")
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_float32_prefill_logits_match_hf(moe, kernels):
    path, model, prompts, _ = moe
    engine = LLMEngine.from_args(str(path), dtype="float32", cpu_kernels=kernels, device=DEVICE)
    with torch.no_grad():
        theirs = model(torch.tensor([prompts[4]])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompts[4]).double().cpu(), theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype, quantization", [("float64", None), ("float32", "int8")])
def test_each_expert_runs_once_a_step_on_all_its_tokens(moe, monkeypatch, dtype, quantization):
    """The (token, expert) pairs grouped by expert: in one forward of a mixed batch each projection of every expert
    some token picked is multiplied exactly once per sparse layer, on exactly the tokens that picked it; the others
    never. float64 runs the experts one by one; int8 weights all of a layer's experts in one grouped call."""
    path, _, prompts, _ = moe
    kernels = "on" if quantization else "auto"  # int8: one kernel path, no autotuning
    engine = LLMEngine.from_args(str(path), dtype=dtype, quantization=quantization, device=DEVICE, cpu_kernels=kernels)
    calls, picked, grouped_calls = [], Counter(), []
    route = SparseMoeBlock.route

    def counting_route(self, x):
        experts = self.linear(x, self.gate).topk(self.top_k, dim=-1).indices  # the softmax keeps the order
        picked.update((id(self), e) for e in experts.flatten().tolist())
        return route(self, x)

    monkeypatch.setattr(SparseMoeBlock, "route", counting_route)
    blocks = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        owner = {id(getattr(expert, name)): (id(block), index, name) for index, expert in enumerate(block.experts)
                 for name in ("gate_up_proj", "down_proj")}

        def linear(x, weight, bias=None, owner=owner, inner=block.linear, router=block.gate):
            if weight is not router:  # (the router scores every token through the same matmul)
                calls.append((owner[id(weight)], x.shape[0]))
            return inner(x, weight, bias)

        def grouped(x, weights, offsets, owner=owner, inner=block.grouped_linear):
            out = inner(x, weights, offsets)
            if out is not None:
                grouped_calls.append(len(weights))
                calls.extend((owner[id(w)], b - a) for w, a, b in zip(weights, offsets, offsets[1:]))
            return out

        block.linear, block.grouped_linear = linear, grouped
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    engine.runner.forward(engine.runner.prepare(engine.scheduler.schedule()))
    expected = sorted((block, expert, name) for block, expert in picked for name in ("gate_up_proj", "down_proj"))
    assert sorted(key for key, _ in calls) == expected  # once each, and only those picked
    assert all(rows == picked[key[:2]] for key, rows in calls)  # on as many rows as tokens picked it
    assert len(grouped_calls) == (2 * len(blocks) if quantization else 0)


def test_greedy_batch_equals_hf_alone(moe):
    path, _, prompts, expected = moe
    llm = LLM(str(path), dtype="float64", block_size=4, device=DEVICE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.kv_cache_usage() == 0.0


def test_greedy_with_preemption_prefix_caching_and_chunked_prefill_equals_hf(moe):
    check_preemption_prefix_caching_and_chunks(*moe)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_experts_compute_their_dequantised_weights(moe, quantization):
    """int8 / int4 weights quantise every expert's projections, each its own (the router stays in the model's
    dtype): a sparse layer computes what the float layer computes with each expert's weights dequantised. (Against
    the float model itself the logits may move far: a router's near-tie that the weights' rounding flips sends a
    token to other experts.)"""
    path, _, _, _ = moe
    float_model = LLMEngine.from_args(str(path), dtype="float32", cpu_kernels="off", device=DEVICE).runner.model
    engine = LLMEngine.from_args(str(path), dtype="float32", quantization=quantization, device=DEVICE,
                                 cpu_kernels="on" if DEVICE == "cpu" else "auto")  # one path: no autotuning
    for ours, reference in zip(engine.runner.model.layers, float_model.layers):
        if not isinstance(ours.mlp, SparseMoeBlock):
            continue
        router = ours.mlp.gate  # a float matmul weight of the model's dtype, not quantised
        packed = router.packed if isinstance(router, TunedWeight) else {"dense": router}
        assert "quant" not in packed and {w.dtype for w in packed.values()} == {torch.float32}
        for expert in swiglu_mlps(reference.mlp):
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(expert, name)
                weight.data = quant.quantize(weight.data, quantization, torch.float32).dequantize()
        x = torch.randn(40, reference.mlp.gate.shape[1], generator=torch.Generator().manual_seed(0))
        # the quantised kernels round x to int16 per group (tests/test_quant.py bounds that), twice in a row here
        torch.testing.assert_close(ours.mlp(x), reference.mlp(x), rtol=1e-3, atol=1e-3)


def test_tensor_parallel_equals_hf(tmp_path):
    """tp=2: each rank holds half of every expert's and the shared expert's intermediate dimension and the router
    whole; the partial sums meet in one all-reduce per layer."""
    architecture, settings = CONFIGS["qwen2-moe"]
    model = build_hf_model(seed=9, architecture=architecture, **settings)
    path = save_hf_model(model, tmp_path / "m")
    prompts = [[5, 9, 2, 6, 5, 3], list(range(40, 77)), [7]]
    llm = LLM(str(path), dtype="float64", block_size=4, tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("layout", ["published", "transformers5"])
@pytest.mark.parametrize("preset, architecture", [("qwen3-moe-tiny", "Qwen3MoeForCausalLM"),
                                                  ("qwen2-moe-tiny", "Qwen2MoeForCausalLM")])
def test_presets_load_in_transformers_and_run(tmp_path, layout, preset, architecture, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mini_infer.factory import make_model

    out = make_model(preset, tmp_path / preset, dtype="float32", layout=layout)
    reference, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float64,
                                                           experts_implementation="eager")
    assert type(reference).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = ModelConfig.from_dir(out)
    assert config.architecture == architecture and config.moe.num_experts == reference.config.num_experts
    # near-ties of the small random weights: HF's RMSNorm in float64 too; no repetition penalty (GREEDY sets none)
    monkeypatch.setattr(type(reference.model.norm), "forward", rms_norm_float64)
    reference.generation_config.repetition_penalty = 1.0
    llm = LLM(str(out), dtype="float64")
    [output] = llm.generate(["The capital of France"], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(reference.eval(), output.prompt_token_ids, MAX_NEW_TOKENS)


@pytest.mark.parametrize("edit, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds num_experts=8"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size must be an integer >= 1, got 0"),
    (dict(mlp_only_layers="all"), r"mlp_only_layers must be a list of layer indices"),
    (dict(norm_topk_prob="yes"), r"norm_topk_prob must be true or false"),
    (dict(attention_bias=True), r"attention_bias true .* not supported"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, edit, message):
    architecture, settings = CONFIGS["qwen3-moe"]
    path = save_hf_model(build_hf_model(seed=1, architecture=architecture, **settings), tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("num_experts", None)
    raw.update({"num_local_experts": 8, **edit})
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("edit, message", [(dict(moe_intermediate_size=18), "moe_intermediate_size=18"),
                                           (dict(shared_expert_intermediate_size=42),
                                            "shared_expert_intermediate_size=42")])
def test_tensor_parallel_must_split_the_experts(tmp_path, edit, message):
    architecture, settings = CONFIGS["qwen2-moe"]
    path = save_hf_model(build_hf_model(seed=1, architecture=architecture, **settings), tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(ValueError, match=f"tensor_parallel_size=4 must divide {message}"):
        LLM(str(path), dtype="float64", tensor_parallel_size=4)
