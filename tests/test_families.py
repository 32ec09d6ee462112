"""Qwen3 (dense) and Llama (3, 3.1, 3.2) checkpoints on the same decoder as Qwen2: float64 parity with HF's
Qwen3ForCausalLM / LlamaForCausalLM (q_norm / k_norm and a head_dim of its own; plain and llama3-scaled RoPE; tied
and untied heads, odd head counts, one KV head) in mixed batches under preemption, prefix caching and chunked
prefill, and under tensor and pipeline parallelism; both config.json layouts; the presets; what is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (DEVICE, FAMILY_NEW_TOKENS, build_hf_model, check_preemption_prefix_caching_and_chunks,
                      family_checkpoint, hf_greedy, prefill_logits, rms_norm_float64, save_hf_model)
from mini_infer import LLM, SamplingParams
from mini_infer.config import ModelConfig
from mini_infer.engine.llm_engine import LLMEngine

# Llama 3.1's scaling with an original context of 64 positions: of head_dim 16's wavelengths at rope_theta 5e5 (6.3,
# 32.4, 167, ...) the first is kept (< 64 / 4), the second blended, the rest stretched (> 64 / 1).
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
# name -> (HF architecture, config)
CONFIGS = {
    # Llama 3.2 1B/3B-like: tied head, GQA, plain RoPE
    "llama-tied-gqa": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     rope_theta=500000.0, tie_word_embeddings=True)),
    # Llama 3.1 8B-like: untied head, 6 heads over 3 KV heads, llama3 RoPE scaling, 3 layers
    "llama3-untied": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                    rope_theta=500000.0, tie_word_embeddings=False, num_hidden_layers=3,
                                    rope_scaling=LLAMA3_SCALING)),
    # a single KV head, another rope_theta, untied
    "llama-untied-1kv": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                       rope_theta=10000.0, tie_word_embeddings=False)),
    # Qwen3 0.6B-like: tied head, head_dim 24 (not hidden / heads = 16), q and k norms
    "qwen3-tied": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                 rope_theta=1e6, tie_word_embeddings=True)),
    # Qwen3 untied, 6 heads over 3 KV heads of 32, 3 layers
    "qwen3-untied": ("qwen3", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                                   rope_theta=1e6, tie_word_embeddings=False, num_hidden_layers=3)),
}
LLAMA_CONFIGS = {name: config for name, (family, config) in CONFIGS.items() if family == "llama"}
MAX_NEW_TOKENS = FAMILY_NEW_TOKENS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    """(checkpoint dir, HF model, prompts, HF greedy continuation of each prompt alone)."""
    architecture, config = CONFIGS[request.param]
    return family_checkpoint(request.param, architecture, config, tmp_path_factory.mktemp(request.param))


def test_config_reads_the_switches(family):
    path, model, _, _ = family
    config = ModelConfig.from_dir(path)
    assert config.architecture == type(model).__name__
    assert not config.attention_bias and config.qk_norm == (config.architecture == "Qwen3ForCausalLM")
    assert config.head_dim == model.config.head_dim
    scaling = (model.config.rope_parameters or {}).get("rope_type") == "llama3"
    assert (config.rope_scaling is not None) == scaling


def test_llama3_frequencies_equal_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mini_infer.model.layers import RotaryEmbedding

    model = build_hf_model(seed=2, architecture="llama", **LLAMA_CONFIGS["llama3-untied"])
    theirs, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    config = ModelConfig.from_dict({**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    plain = RotaryEmbedding(16, 500000.0, 200, dtype=torch.float32, device="cpu")
    ours = RotaryEmbedding(16, 500000.0, 200, dtype=torch.float32, device="cpu", scaling=config.rope_scaling)
    # the first column of the table is position 1's angles: the frequencies themselves
    ours_freq, plain_freq = ours.sin[1, :8].asin(), plain.sin[1, :8].asin()
    torch.testing.assert_close(ours_freq, theirs.float(), rtol=1e-6, atol=0)
    assert attention_scaling == 1.0
    ratio = ours_freq / plain_freq
    kept, blended, stretched = ratio[0], ratio[1], ratio[2:]
    assert kept == pytest.approx(1.0) and 1 / 8 < blended < 1 and torch.allclose(stretched, torch.tensor(1 / 8))


def test_float64_logits_exact_against_full_precision_reference(family, monkeypatch):
    """With HF's RMSNorm computing in float64 too (it normalises in float32 even in a float64 model), our prefill
    logits agree with HF's to float64 rounding, the q/k norms and the scaled RoPE frequencies included."""
    path, model, prompts, _ = family
    monkeypatch.setattr(type(model.model.norm), "forward", rms_norm_float64)
    for prompt in prompts:
        ours = prefill_logits(LLMEngine.from_args(str(path), dtype="float64", device=DEVICE), prompt)
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_float32_prefill_logits_match_hf(family, kernels):
    path, model, prompts, _ = family
    engine = LLMEngine.from_args(str(path), dtype="float32", cpu_kernels=kernels, device=DEVICE)
    with torch.no_grad():
        theirs = model(torch.tensor([prompts[4]])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompts[4]).double().cpu(), theirs, rtol=1e-3, atol=1e-3)


def test_greedy_batch_equals_hf_alone(family):
    path, _, prompts, expected = family
    llm = LLM(str(path), dtype="float64", block_size=4, device=DEVICE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.kv_cache_usage() == 0.0


def test_greedy_with_preemption_prefix_caching_and_chunked_prefill_equals_hf(family):
    check_preemption_prefix_caching_and_chunks(*family)


def test_both_config_layouts_load_identically(tmp_path):
    """transformers 5's rope_parameters and the published Llama 3.1 spelling (top-level rope_theta, rope_scaling
    with rope_type llama3, torch_dtype): the same logits to the bit."""
    model = build_hf_model(seed=5, architecture="llama", **LLAMA_CONFIGS["llama3-untied"])
    t5 = save_hf_model(model, tmp_path / "t5")
    published = save_hf_model(model, tmp_path / "published")
    raw = json.loads((published / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    raw["torch_dtype"] = raw.pop("dtype")
    (published / "config.json").write_text(json.dumps(raw))
    prompt = list(range(3, 90))
    first, second = (prefill_logits(LLMEngine.from_args(str(p), dtype="float64", device=DEVICE), prompt)
                     for p in (t5, published))
    assert torch.equal(first, second)


@pytest.mark.parametrize("edit, message", [
    (dict(architectures=["MistralForCausalLM"]),
     r"MistralForCausalLM.*not supported; mini-infer runs Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"),
    (dict(mlp_bias=True), r"mlp_bias true .* not supported"),
    (dict(attention_bias=True), r"attention_bias true .* not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     r"rope type 'llama3' needs numbers low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING, "low_freq_factor": 4.0}),
     r"0 < low_freq_factor < high_freq_factor"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}),
     r"rope type 'dynamic' is not supported \(only default and llama3\)"),
])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_unsupported_configs_are_refused_by_name(tmp_path, edit, message, architecture):
    model = build_hf_model(seed=1, architecture=architecture, num_hidden_layers=1)
    path = save_hf_model(model, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw.update(edit)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("layout", ["published", "transformers5"])
@pytest.mark.parametrize("preset, architecture", [("llama3-tiny", "LlamaForCausalLM"),
                                                  ("qwen3-tiny", "Qwen3ForCausalLM")])
def test_presets_load_in_transformers_and_run(tmp_path, layout, preset, architecture, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mini_infer.factory import make_model

    out = make_model(preset, tmp_path / preset, dtype="float32", layout=layout)
    reference, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float64)
    assert type(reference).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = ModelConfig.from_dir(out)
    assert config.architecture == architecture
    if preset == "llama3-tiny":
        assert reference.config.rope_parameters["rope_type"] == "llama3" and config.rope_scaling.factor == 32.0
    else:
        assert config.qk_norm and config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    # The presets' small random weights leave near-ties that HF's float32 normalisation would flip; HF's generate
    # would also apply the preset's generation_config.json repetition_penalty (1.1), which GREEDY does not set.
    monkeypatch.setattr(type(reference.model.norm), "forward", rms_norm_float64)
    reference.generation_config.repetition_penalty = 1.0
    llm = LLM(str(out), dtype="float64")
    [output] = llm.generate(["The capital of France"], GREEDY, use_tqdm=False)
    prompt = output.prompt_token_ids
    assert output.outputs[0].token_ids == hf_greedy(reference.eval(), prompt, MAX_NEW_TOKENS)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_tensor_and_pipeline_parallel_equal_hf(tmp_path, layout):
    """Qwen3 (no QKV bias: the zero one splits; q/k norms whole on every tensor rank), tied head on the last
    stage."""
    model = build_hf_model(seed=9, architecture="qwen3", **CONFIGS["qwen3-tied"][1])
    path = save_hf_model(model, tmp_path / "m")
    prompts = [[5, 9, 2, 6, 5, 3], list(range(40, 77)), [7]]
    llm = LLM(str(path), dtype="float64", block_size=4, **layout)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]
    finally:
        llm.engine.shutdown()
