"""GGUF files (mini_infer/gguf_file.py, model/gguf_weights.py): written here as llama.cpp's convert_hf_to_gguf.py writes
them (gguf-py's writer, its tensor-name map and its quantisers, which are llama.cpp's reference), from perturbed random
models; float files give the safetensors model's logits exactly, Q8_0 and Q4_0 weights load as llama.cpp dequantises
them bit for bit and run as the float64 model of those weights, the file's own vocabulary tokenizes as the model's
tokenizer, and what does not load is refused by name. With the llama.cpp peer set up (mini-infer bench), its own
converter's files are loaded too."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.gguf_file import GGUFHeader, hf_config

gguf = pytest.importorskip("gguf")

ARCHS = {"qwen2": "QWEN2", "qwen3": "QWEN3", "llama": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}
# Kept in float32 by the converter whatever --outtype says (a MoE layer's router and shared-expert gate).
FLOAT_KEPT = ("mlp.gate.weight", "shared_expert_gate.weight")
QTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
PROMPTS = [[5, 17, 42, 99, 3], [200, 11, 7], [64, 64, 1, 250, 31, 8, 12]]
_NATIVE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
native = pytest.mark.skipif(not _NATIVE,
                            reason="quantised GGUF weights run on the native kernels, which need AVX2 + FMA")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, outtype: str = "f32", tokenizer_dir: Path | None = None,
               k_quants: dict[str, str] | None = None) -> Path:
    """`model` (a transformers model) as a GGUF file: 2-D weights in `outtype`, 1-D tensors F32 (as the converter
    writes them), with the tokenizer of `tokenizer_dir` as GGUF vocabulary metadata when given. `k_quants`: HF name
    suffix -> Q4_K / Q5_K / Q6_K for the weights to write as random blocks of that type (gguf-py has no K-quant
    quantiser; the file's weights are then those blocks, not the model's)."""
    config = model.config
    arch = getattr(gguf.MODEL_ARCH, ARCHS[config.model_type])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    rope_theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.model_type.startswith("qwen3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.model_type.endswith("moe"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if config.model_type == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if tokenizer_dir is not None:
        _add_vocabulary(writer, tokenizer_dir, config.vocab_size)
    scaling = (getattr(config, "rope_parameters", None) or {})
    if scaling.get("rope_type") == "llama3":  # the converter's rope_freqs: a factor per rotary frequency
        writer.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, rope_theta, scaling))
    qtype = getattr(gguf.GGMLQuantizationType, QTYPES[outtype])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, data in _converter_tensors(model):
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _permute(data, heads)
        target = qtype if data.ndim >= 2 and not name.endswith(FLOAT_KEPT) else gguf.GGMLQuantizationType.F32
        kind = next((k for suffix, k in (k_quants or {}).items() if name.endswith(suffix)), None)
        if kind is not None:
            target = getattr(gguf.GGMLQuantizationType, kind)
            stored = random_k_blocks(kind, *data.shape, seed=len(name) + data.size)
        else:
            stored = gguf.quants.quantize(data, target) if target != gguf.GGMLQuantizationType.F32 else data
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), stored, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, cols / 256 blocks' bytes] of Q4_K, Q5_K or Q6_K with random integers, scales and mins, their float16 d
    (and dmin) chosen so that the weights come out near the test models' (|w| up to ~0.3)."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, size=(rows, cols // 256)).astype(np.float16)
    if kind in ("Q4_K", "Q5_K"):  # d sc q - dmin m, sc and m in 0..63, q in 0..15 (Q5_K: 0..31)
        blocks[:, :, 0:2] = (d * np.float16(3e-4 if kind == "Q4_K" else 1.5e-4)).view(np.uint8).reshape(rows, -1, 2)
        blocks[:, :, 2:4] = (d * np.float16(2e-3)).view(np.uint8).reshape(rows, -1, 2)
    else:  # d sc (q - 32), sc in -128..127, q in 0..63
        blocks[:, :, 208:210] = (d * np.float16(1e-4)).view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def _converter_tensors(model):
    """(name, float32 array) of the tensors the converter writes: the tied head left out; a MoE layer's experts as
    transformers 5 holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]) split into the converter's gate, up and
    down [E, out, in]."""
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = np.split(data, 2, axis=1)
            yield f"{base}gate_proj.weight", np.ascontiguousarray(gate)
            yield f"{base}up_proj.weight", np.ascontiguousarray(up)
        elif name.endswith("mlp.experts.down_proj"):
            yield f"{name}.weight", data
        else:
            yield name, data


def _llama3_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs: 1 for short wavelengths, `factor` for long ones, and between the
    two 1 / ((1 - smooth) / factor + smooth)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_vocabulary(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    """A BPE tokenizer.json as the converter's gpt2-model vocabulary (tokens by id, padded to the vocabulary size)."""
    raw = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokens = {i: token for token, i in raw["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in raw["added_tokens"]}
    tokens.update(special)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    writer.add_token_types([3 if i in special else (1 if i in tokens else 5) for i in range(vocab_size)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]])
    settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    writer.add_eos_token_id({token: i for i, token in tokens.items()}[settings["eos_token"]])
    writer.add_chat_template(settings["chat_template"])


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _model(architecture: str, seed: int, dtype=torch.float32):
    extra = {"qwen3": dict(head_dim=32), "qwen3_moe": dict(head_dim=32, norm_topk_prob=True, **MOE),
             "qwen2_moe": dict(shared_expert_intermediate_size=64, **MOE)}.get(architecture, {})
    return build_hf_model(seed=seed, vocab_size=300, architecture=architecture, tie_word_embeddings=seed % 2 == 0,
                          **extra).to(dtype)


def _prompt_logprobs(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [([{t: lp.logprob for t, lp in step.items()} for step in out.prompt_logprobs[1:]], out.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]) for out in outputs]


@pytest.mark.parametrize("architecture,outtype,dtype", [
    ("qwen2", "f32", torch.float32), ("qwen3", "bf16", torch.bfloat16), ("llama", "f16", torch.float16),
    ("llama", "f32", torch.float32), ("qwen3_moe", "f32", torch.float32), ("qwen2_moe", "bf16", torch.bfloat16)])
def test_a_float_gguf_gives_the_safetensors_models_logits(tmp_path, architecture, outtype, dtype):
    """The same weights from a GGUF file and from the safetensors checkpoint: equal logprobs, token for token (both run
    in float32; the checkpoint is saved in the file's dtype, so neither rounds what the other does not)."""
    model = _model(architecture, seed=len(architecture) + len(outtype), dtype=dtype)
    model.save_pretrained(tmp_path / "hf")
    write_gguf(model, tmp_path / "model.gguf", outtype)
    ours = _prompt_logprobs(LLM(str(tmp_path / "model.gguf"), dtype="float32", num_kv_blocks=32))
    reference = _prompt_logprobs(LLM(str(tmp_path / "hf"), dtype="float32", num_kv_blocks=32))
    assert ours == reference


def test_llama_3_1s_scaled_rope_loads_from_the_files_frequency_factors(tmp_path):
    """Llama 3.1's RoPE scaling reaches a GGUF file as llama.cpp's rope_freqs (a factor per frequency): the same
    frequencies, computed in another order in float32, so the logprobs agree to float32 rounding and the tokens
    exactly."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    model = build_hf_model(seed=11, vocab_size=300, architecture="llama", rope_scaling=scaling)
    model.save_pretrained(tmp_path / "hf")
    llm = LLM(str(write_gguf(model, tmp_path / "model.gguf")), dtype="float32", num_kv_blocks=32)
    factors = llm.engine.config.model_config.rope_freq_factors
    assert factors is not None and 1.0 in factors and 8.0 in factors and any(1 < f < 8 for f in factors)
    ours, reference = _prompt_logprobs(llm), _prompt_logprobs(LLM(str(tmp_path / "hf"), dtype="float32",
                                                                  num_kv_blocks=32))
    for (prompt, tokens, steps), (prompt_ref, tokens_ref, steps_ref) in zip(ours, reference):
        assert tokens == tokens_ref
        for step, step_ref in zip(prompt + steps, prompt_ref + steps_ref):
            assert step.keys() == step_ref.keys()
            assert all(abs(step[t] - step_ref[t]) < 1e-4 for t in step)


@native
@pytest.mark.parametrize("architecture,outtype", [("qwen2", "q8_0"), ("llama", "q4_0"), ("qwen3", "q8_0"),
                                                  ("qwen3_moe", "q4_0"), ("qwen2_moe", "q8_0")])
def test_q8_0_and_q4_0_load_as_llama_cpp_dequantises_and_run_as_the_float64_model_of_those_weights(
        tmp_path, architecture, outtype):
    from gguf import GGUFReader

    from mini_infer.model.gguf_weights import named_tensors, quantized

    model = _model(architecture, seed=3 if outtype == "q8_0" else 4)
    path = write_gguf(model, tmp_path / "model.gguf", outtype)
    weights = {tensor.name: gguf.quants.dequantize(tensor.data, tensor.tensor_type)
               for tensor in GGUFReader(str(path)).tensors if tensor.tensor_type.name == outtype.upper()}
    for _, tensor in named_tensors(GGUFHeader(path)):  # a MoE layer's experts one by one: "blk.N.ffn_up_exps[e]"
        if tensor.tensor_type.name == outtype.upper():
            ours = quantized(tensor).dequantize().numpy()
            name, _, expert = tensor.name.partition("[")
            theirs = weights[name][int(expert[:-1])] if expert else weights[name]
            assert ours.shape == theirs.shape and np.array_equal(ours, theirs), tensor.name  # bit for bit
    reference = _float64_model_of(model, weights, architecture)
    llm = LLM(str(path), dtype="float32", cpu_kernels="on", num_kv_blocks=32)
    assert llm.engine.config.model_config.quantization.method == "gguf"
    _assert_greedy_as(llm, reference)


def _float64_model_of(model, weights: dict[str, np.ndarray], architecture: str):
    """HF's `model` in float64 holding the file's dequantised `weights` (by llama.cpp name; a MoE layer's experts
    stacked; permuted back for Llama, as the converter's inverse); a weight the file lacks keeps the model's."""
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[architecture]), model.config.num_hidden_layers)
    reference = model.double()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("mlp.experts.gate_up_proj"):  # the file's gate and up experts, stacked as HF holds them
                gate, up = (weights[names.get_name(f"{name.removesuffix('gate_up_proj')}{part}.weight",
                                                   try_suffixes=(".weight",))] for part in ("gate_proj", "up_proj"))
                param.copy_(torch.from_numpy(np.concatenate([gate, up], axis=1)))
                continue
            if name.endswith("mlp.experts.down_proj"):
                name += ".weight"  # (HF's stacked experts are named without it)
            stored = weights.get(names.get_name(name, try_suffixes=(".weight", ".bias")))
            if stored is None or (name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = model.config.num_attention_heads if "q_proj" in name else model.config.num_key_value_heads
                stored = stored.reshape(heads, stored.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(
                    stored.shape)
            param.copy_(torch.from_numpy(np.array(stored)).reshape(param.shape))
    return reference


def _assert_greedy_as(llm: LLM, reference) -> None:
    """llm's greedy tokens and their logprobs are the float64 reference's, within the kernels' int16 rounding."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)):
        out = out.outputs[0]
        ids = torch.tensor([prompt + list(out.token_ids)])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(out.token_ids):
            # the kernel's int16 rounding of the activations (tests/test_prequantized.py: the same bound)
            assert abs(out.logprobs[step][token].logprob - expected[step, token].item()) < 3e-3
            assert expected[step, token] >= expected[step].max() - 6e-3


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_load_as_gguf_pys_dequantisation(tmp_path, kind):
    """K-quant blocks keep their integers and both levels of scales (int8 sub-scales and mins under float16 d and
    dmin), and dequantise to gguf-py's weights bit for bit."""
    from mini_infer.model.gguf_weights import named_tensors, quantized

    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", random_k_blocks(kind, 40, 512, seed=3),
                      raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(_, tensor)] = list(named_tensors(GGUFHeader(tmp_path / "k.gguf")))
    qt = quantized(tensor)
    theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    expected = {"Q4_K": (4, 32, True, 8), "Q5_K": (8, 32, True, 8), "Q6_K": (6, 16, False, 16)}[kind]
    assert (qt.bits, qt.group, qt.zeros is not None, qt.super_groups) == expected
    assert qt.scales.dtype == torch.int8 and qt.super_scales.dtype == torch.float16
    assert qt.super_scales.shape == (40, 2) and qt.scales.shape == (40, 512 // expected[1])
    ours = qt.dequantize().numpy()
    assert ours.shape == theirs.shape == (40, 512) and np.abs(theirs).max() > 0.05
    assert np.array_equal(ours, theirs)


def q4_k_m_style_file(tmp_path, seed: int, o_type: str, up_type: str = "Q4_K"):
    """A random HF model and its GGUF file in a Q4_K_M mix: Q4_K q, k and gate beside Q6_K v, down and LM head,
    o_proj in `o_type`, up_proj in `up_type`."""
    model = build_hf_model(seed=seed, vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False)
    k_quants = {"q_proj.weight": "Q4_K", "k_proj.weight": "Q4_K", "v_proj.weight": "Q6_K", "o_proj.weight": o_type,
                "gate_proj.weight": "Q4_K", "up_proj.weight": up_type, "down_proj.weight": "Q6_K",
                "lm_head.weight": "Q6_K", "embed_tokens.weight": "Q4_K"}
    tmp_path.mkdir(exist_ok=True)
    return model, write_gguf(model, tmp_path / "model.gguf", "f32", k_quants=k_quants)


@native
def test_a_q4_k_m_style_file_runs_as_the_float64_model_of_its_weights(tmp_path):
    """Q4_K q, k, gate and up beside Q6_K v, down and LM head (a Q4_K_M mix) and a Q5_K o: the fused q/k/v and gate/up
    keep parts of different types apart, each its own matmul; greedy tokens and logprobs as HF's float64 model of the
    file's dequantised weights, within the kernels' int16 rounding (as the Q8_0 / Q4_0 test's bound)."""
    from gguf import GGUFReader

    model, path = q4_k_m_style_file(tmp_path, seed=6, o_type="Q5_K")
    weights = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, model.config.num_hidden_layers)
    reference = model.double()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(torch.from_numpy(np.array(weights[names.get_name(name, try_suffixes=(".weight", ".bias"))]))
                        .reshape(param.shape))
    llm = LLM(str(path), dtype="float32", cpu_kernels="on", num_kv_blocks=32)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, tuple) and len(qkv) == 3  # q, k (Q4_K) and v (Q6_K): three matmuls
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)):
        out = out.outputs[0]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + list(out.token_ids)])).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(out.token_ids):
            assert abs(out.logprobs[step][token].logprob - expected[step, token].item()) < 3e-3
            assert expected[step, token] >= expected[step].max() - 6e-3


@native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_qkv_of_differently_quantised_parts_runs_in_the_one_call_decoder_as_op_by_op(tmp_path, monkeypatch, dtype):
    """A Q4_K_M mix's q and k (Q4_K) beside v (Q6_K): the one-call decode step runs each part's matmul into its
    columns and adds the bias as the per-op path's concatenation and add do: the same tokens and logprobs."""
    from mini_infer.kernels.decoder import DecoderStack
    from mini_infer.model.qwen2 import Qwen2ForCausalLM

    _, path = q4_k_m_style_file(tmp_path, seed=7, o_type="Q4_K")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(str(path), dtype=dtype, cpu_kernels="on", num_kv_blocks=32)
        assert all(isinstance(layer.self_attn.qkv_proj, tuple) for layer in llm.engine.runner.model.layers)
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]

    calls = []
    stack_call = DecoderStack.__call__
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *a: calls.append(1) or stack_call(self, *a))
    stacked = run()
    assert len(calls) >= 7  # every decode step ran through the stack
    monkeypatch.setattr(Qwen2ForCausalLM, "_decoder_stack", lambda *args: None)
    assert run() == stacked
    # Parts elsewhere (a Q5_K up beside a Q4_K gate) are the per-op path's alone: such a file decodes op by op.
    monkeypatch.undo()
    llm = LLM(str(q4_k_m_style_file(tmp_path / "up", seed=7, o_type="Q4_K", up_type="Q5_K")[1]), dtype=dtype,
              cpu_kernels="on", num_kv_blocks=32)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, tuple)
    calls.clear()
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *a: calls.append(1) or stack_call(self, *a))
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    assert not calls


# A tiny MoE preset (8 experts) with K-quant-sized rows: 256 weights or a multiple of them.
STRAIGHT = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64, num_attention_heads=4,
                num_key_value_heads=2)


@native
def test_a_q4_k_m_file_written_straight_runs_as_the_float64_model_of_its_weights(tmp_path):
    """make-model --gguf q4_k_m (factory/gguf_writer.py: random blocks of the types llama-quantize gives, here Q4_K,
    Q6_K, and Q8_0 / Q5_K for an 8-expert model's attention): mini-infer reads the file's vocabulary as the preset's
    tokenizer and runs it as HF's float64 model of the file's dequantised weights."""
    import transformers

    from mini_infer.factory import PRESETS, write_config, write_tokenizer
    from mini_infer.factory.gguf_writer import make_gguf
    from mini_infer.model.gguf_weights import quantized

    path = make_gguf("qwen3-moe-tiny", tmp_path / "model.gguf", "q4_k_m", seed=2, overrides=STRAIGHT)
    tensors = GGUFHeader(path).tensors  # (as gguf-py's GGUFReader reads them, in a fraction of its time)
    assert {t.tensor_type.name for t in tensors} == {"F32", "Q4_K", "Q6_K", "Q8_0", "Q5_K"}
    # gguf-py's dequantisation (llama.cpp's reference), but for the (tied) embedding's 39M weights, which takes it 10 s:
    # mini-infer's reading of those blocks, equal to gguf-py's bit for bit (test_k_quant_blocks_load_as_gguf_pys_...)
    weights = {t.name: quantized(t).dequantize().numpy() if t.name == "token_embd.weight" else
               gguf.quants.dequantize(t.data, t.tensor_type) for t in tensors}
    (tmp_path / "config").mkdir()
    write_config(tmp_path / "config", PRESETS["qwen3-moe-tiny"] | STRAIGHT)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "config", experts_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()  # HF's grouped matmul refuses float64
    reference = _float64_model_of(model, weights, "qwen3_moe")
    llm = LLM(str(path), dtype="float32", cpu_kernels="on", num_kv_blocks=32)
    _assert_greedy_as(llm, reference)
    write_tokenizer(tmp_path / "tokenizer", "qwen3")
    text = "Hello, world! 你好 <|im_start|>user\n<think>\n  def f(x):\n\treturn x  "
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert llm.get_tokenizer().encode(text) == expected.encode(text)


def test_the_files_own_vocabulary_tokenizes_as_the_models_tokenizer(tiny_model_dir, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = write_gguf(model, tmp_path / "tiny.gguf", "f32", tokenizer_dir=tiny_model_dir)
    ours = LLM(str(path), dtype="float32", num_kv_blocks=32)
    theirs = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    text = "Hello, world! 你好 <|im_start|>user\n  def f(x):\n\treturn x  "
    assert ours.get_tokenizer().encode(text) == theirs.get_tokenizer().encode(text)
    chat = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    assert ([o.outputs[0].text for o in ours.chat([chat], params, use_tqdm=False)]
            == [o.outputs[0].text for o in theirs.chat([chat], params, use_tqdm=False)])


def test_the_header_reads_as_gguf_pys_reader_reads_it(tmp_path):
    """Our one-pass reader against llama.cpp's (gguf-py's GGUFReader): every metadata value and tensor the same."""
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_token_list([f"tok{i}" for i in range(40)] + ["ünï", ""])
    writer.add_token_types([1, 3] * 21)
    writer.add_token_scores([0.5 * i for i in range(42)])
    writer.add_bool("test.flag", True)
    writer.add_int64("test.big", -2**40)
    writer.add_float64("test.double", 1 / 3)
    writer.add_uint16("test.small", 7)
    writer.add_string("test.text", "a line\nand 你好")
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    for name, kind in (("a", "F32"), ("b", "F16"), ("c", "BF16"), ("d", "Q8_0"), ("e", "Q4_0")):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        data = rng.standard_normal((3, 256)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(data, qtype) if kind not in ("F32", "F16") else
                          data.astype(np.float16 if kind == "F16" else np.float32), raw_dtype=qtype)
    # a Q6_K tensor's bytes (210 a block of 256; gguf-py has no Q6_K quantiser)
    writer.add_tensor("f", rng.integers(0, 256, (3, 210), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.add_tensor("g", rng.standard_normal(5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(str(path))
    # (gguf-py flattens an array of arrays, a FIXME of its own; ours keeps them nested)
    assert ours.fields.pop("test.nested") == [[1, 2], [3]]
    assert ours.fields == {key: value.contents() for key, value in theirs.fields.items()
                           if not key.startswith("GGUF.") and key != "test.nested"}
    assert len(ours.tensors) == len(theirs.tensors) == 7
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, [int(n) for n in b.shape])
        assert a.data.tobytes() == b.data.tobytes(), a.name
        # (gguf-py gives BF16 values as their bytes, two a value; ours as 16-bit integers)
        assert a.data.shape == (b.data.shape if a.tensor_type.name != "BF16" else (3, 256)), a.name


def test_what_does_not_load_is_refused_by_name(tmp_path):
    model = _model("qwen2", seed=7)
    path = write_gguf(model, tmp_path / "model.gguf", "f32")
    assert hf_config(GGUFHeader(path), "x")[0]["architectures"] == ["Qwen2ForCausalLM"]
    # a K-quant tensor of a type not loaded (Q3_K)
    k_quant = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(k_quant), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((300, 110), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q3_K)  # one 110-byte block of 256 values a row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tensor 'token_embd.weight' is Q3_K; mini-infer loads GGUF tensors of types"):
        LLM(str(k_quant))
    # an architecture we do not run
    other = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(other), "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture 'gemma' is not supported"):
        LLM(str(other))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        LLM(str(tmp_path / "missing.gguf"))


@native
def test_a_quantised_gguf_runs_in_one_tensor_parallel_rank(tmp_path):
    path = write_gguf(_model("qwen2", seed=8), tmp_path / "model.gguf", "q8_0")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 for a gguf checkpoint"):
        LLM(str(path), tensor_parallel_size=2)


def _converter() -> Path | None:
    from mini_infer.bench.peer_env import PeerVenv
    from mini_infer.bench.peers import LLAMA_CPP_SDIST

    script = PeerVenv("llama.cpp").root / LLAMA_CPP_SDIST / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def _convert_side_by_side(jobs: dict[str, tuple[Path, Path]]) -> None:
    """Each name's checkpoint (source, out) as a bf16 GGUF file written by llama.cpp's own converter
    (convert_hf_to_gguf.py), the conversions at once (each a single-threaded Python process of ~10 s)."""
    script = _converter()
    env = {"PYTHONPATH": str(script.parents[3] / "converter-deps"), "PATH": "/usr/bin:/bin"}
    running = {}
    for name, (source, out) in jobs.items():  # its log to a file beside the output: a full pipe would stall it
        with open(out.with_suffix(".log"), "w") as log:
            running[name] = subprocess.Popen([sys.executable, str(script), str(source), "--outtype", "bf16",
                                              "--outfile", str(out)], stdout=log, stderr=subprocess.STDOUT, env=env)
    failed = {name: jobs[name][1].with_suffix(".log").read_text()[-2000:] for name, process in running.items()
              if process.wait() != 0}
    assert not failed, failed


def _assert_loads_as(path: Path, source: Path, same_logits: bool) -> None:
    """The file's own vocabulary tokenizes as the checkpoint's tokenizer; with `same_logits` (a float file of the
    checkpoint's own dtype) its prompt and output logprobs are the checkpoint's. (On the native kernels without
    timing them: the mixture's LM head alone takes ~20 s to time.)"""
    settings = dict(dtype="float32", num_kv_blocks=32, cpu_kernels="on" if _NATIVE else "off")
    ours, theirs = LLM(str(path), **settings), LLM(str(source), **settings)
    text = "Hello, world! 你好"
    assert ours.get_tokenizer().encode(text) == theirs.get_tokenizer().encode(text)
    if same_logits:
        assert _prompt_logprobs(ours) == _prompt_logprobs(theirs)


def _quantize_tool() -> Path | None:
    from mini_infer.bench.peer_env import PeerVenv

    tool = PeerVenv("llama.cpp-tools").root / "build" / "bin" / "llama-quantize"
    return tool if tool.is_file() and _converter() is not None else None


# The mixture of the llama.cpp tests below: 16 experts, an untied head, 9 layers (llama-quantize's use_more_bits picks
# layers 0, 3, 6, 7 and 8 for Q6_K in a Q4_K_M), K-quant-able sizes.
MOE_OVERRIDES = STRAIGHT | dict(num_hidden_layers=9, num_experts=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """"tiny" (the dense preset) and "moe" (the MOE_OVERRIDES qwen3-moe-tiny) -> (the checkpoint in bfloat16, its bf16
    GGUF file by llama.cpp's converter), converted side by side once for the tests that load and quantise them."""
    from mini_infer.factory import make_model

    root = tmp_path_factory.mktemp("converted")
    sources = {"tiny": make_model("tiny", root / "tiny", seed=1, dtype="bfloat16"),
               "moe": make_model("qwen3-moe-tiny", root / "moe", seed=1, dtype="bfloat16", overrides=MOE_OVERRIDES)}
    jobs = {name: (source, root / f"{name}.gguf") for name, source in sources.items()}
    _convert_side_by_side(jobs)
    return jobs


@pytest.mark.skipif(_converter() is None, reason="the llama.cpp peer (its convert_hf_to_gguf.py) is not set up here")
def test_llama_cpps_own_converter_writes_files_that_load(converted):
    source, path = converted["tiny"]
    _assert_loads_as(path, source, same_logits=True)


def _quantize(path: Path, file_type: str, out: Path) -> Path:
    subprocess.run([str(_quantize_tool()), str(path), str(out), file_type], check=True, capture_output=True)
    return out


@pytest.mark.skipif(_quantize_tool() is None, reason="the llama.cpp peer's converter and llama-quantize are not set "
                                                     "up here")
@native
def test_a_mixture_converted_and_quantised_by_llama_cpp_loads(converted, tmp_path):
    """qwen3moe's merged expert tensors as llama.cpp writes them: its bf16 file gives the checkpoint's logprobs, and
    its llama-quantize Q8_0 of that file loads with the same vocabulary."""
    source, bf16 = converted["moe"]
    _assert_loads_as(bf16, source, same_logits=True)
    _assert_loads_as(_quantize(bf16, "Q8_0", tmp_path / "q8_0.gguf"), source, same_logits=False)


@pytest.mark.skipif(_quantize_tool() is None, reason="the llama.cpp peer's converter and llama-quantize are not set "
                                                     "up here")
def test_a_file_written_straight_has_the_types_llama_quantize_gives(converted, tmp_path):
    """Each tensor of make-model's Q4_K_M file has the type llama-quantize gives it in a Q4_K_M of the same preset
    (converted to bf16 by llama.cpp's converter first). (The 8-expert case's Q8_0 / Q5_K attention was compared so
    once, on 16 layers, not here: a second conversion costs another 10-30 s.)"""
    from mini_infer.factory.gguf_writer import make_gguf

    theirs = _quantize(converted["moe"][1], "Q4_K_M", tmp_path / "theirs.gguf")
    ours = make_gguf("qwen3-moe-tiny", tmp_path / "ours.gguf", "q4_k_m", overrides=MOE_OVERRIDES)
    types = {t.name: (t.tensor_type.name, list(t.shape)) for t in GGUFHeader(theirs).tensors}
    assert {t.name: (t.tensor_type.name, list(t.shape)) for t in GGUFHeader(ours).tensors} == types
    assert {kind for kind, _ in types.values()} >= {"Q4_K", "Q6_K"}


def test_the_bench_runs_a_gguf_file_as_it_is(tmp_path):
    """`mini-infer bench --model file.gguf` benches the file's directory (bench/cli.py): mini-infer runs the file
    (llama.cpp, where set up, the very same file: bench/peers.py); HF's systems, which run safetensors checkpoints,
    are refused by name."""
    from mini_infer.bench.systems import SystemFactory
    from mini_infer.gguf_file import model_dir

    path = write_gguf(_model("qwen2", seed=9), tmp_path / "model.gguf", "q8_0")
    factory = SystemFactory(str(model_dir(path)), "float32", max_requests=2, max_seq_len=16, log=lambda m: None)
    result = factory.build("mini-infer").run([[1, 2, 3], [4, 5]], [3, 2])
    assert [len(ids) for ids in result.token_ids] == [3, 2]
    with pytest.raises(ValueError, match="hf-generate runs a safetensors checkpoint; the model is a GGUF file"):
        factory.build("hf-generate")


@native
def test_the_kl_workload_scores_a_gguf_file_against_its_base(tiny_model_dir, tmp_path, short_kl_workload):
    """`bench --workload kl --model file.gguf --kl-base BASE` (bench/kl.py): mini-infer's engine of the file against
    its engine of the base, over the text's first half (two chunks of 512, 255 positions each): the F32 file of the
    model is the model (KL 0, every top-1 the same); its Q8_0 file strays, a little."""
    import argparse

    import transformers

    from mini_infer.bench.options import BenchOptions, add_bench_args
    from mini_infer.gguf_file import model_dir

    kl = short_kl_workload
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    options = BenchOptions.from_args(parser.parse_args(["--workload", "kl", "--systems", "mini-infer", "--dtype",
                                                        "float32", "--kl-base", str(tiny_model_dir)]))
    scores = {}
    for outtype in ("f32", "q8_0"):
        path = write_gguf(model, tmp_path / f"tiny-{outtype}.gguf", outtype)
        report = kl.run_kl(options, str(model_dir(path, tiny_model_dir)), lambda message: None)
        scores[outtype] = report["systems"]["mini-infer"]
        assert report["config"]["base"] == str(tiny_model_dir) and scores[outtype]["positions"] == 2 * 255
    assert scores["f32"]["mean_kl"] == 0 and scores["f32"]["top1_same_pct"] == 100
    assert 0 < scores["q8_0"]["mean_kl"] < 0.05
    with pytest.raises(ValueError, match="is not a GGUF file's"):
        kl.run_kl(options, str(tiny_model_dir), lambda message: None)


@native
def test_a_gguf_file_drafts_for_a_safetensors_target(tmp_path):
    """A Q8_0 GGUF of the target's own weights as its draft (llama.cpp's --model-draft takes GGUF files): greedy
    tokens equal speculation off's, and drafts are accepted (the draft is the target, quantised)."""
    model = _model("qwen2", seed=12)
    model.save_pretrained(tmp_path / "target")
    draft = write_gguf(model, tmp_path / "draft.gguf", "q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(str(tmp_path / "target"), dtype="float32", num_kv_blocks=64)
    spec = LLM(str(tmp_path / "target"), dtype="float32", num_kv_blocks=64,
               speculative_config={"model": str(draft), "num_speculative_tokens": 3, "adaptive": False})
    assert ([o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)])
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


def test_a_converted_vocabulary_is_the_same_vocabulary(tmp_path):
    """A GGUF file's vocabulary, converted, spells its tokenizer.json otherwise and may carry the converter's padding
    tokens: the same ids for the same tokens is the same vocabulary (a draft's check), any other token or id is not."""
    from mini_infer.config import _same_vocabulary

    def tokenizer(name: str, vocab: dict, added: list) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab},
                                    "added_tokens": [{"id": i, "content": t} for t, i in added]}))
        return path

    hf = tokenizer("hf", {"a": 0, "b": 1}, [("<|end|>", 2)])
    assert _same_vocabulary(hf, tokenizer("gguf", {"a": 0, "b": 1, "<|end|>": 2, "[PAD3]": 3}, []))
    assert not _same_vocabulary(hf, tokenizer("moved", {"a": 0, "b": 2}, [("<|end|>", 1)]))
    assert not _same_vocabulary(hf, tokenizer("more", {"a": 0, "b": 1, "c": 3}, [("<|end|>", 2)]))
