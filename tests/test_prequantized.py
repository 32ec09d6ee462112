"""Pre-quantised checkpoints (model/prequantized.py): GPTQ (4 and 8 bits, groups, one group per row, act-order,
v1 and v2 zero points) and AWQ (GEMM packing) written by tests/prequant_checkpoints.py load to exactly the weights the
formats' documented unpacking gives, run as the float model of those weights does, keep a request's tokens under
batching, preemption, prefix caching and chunked prefill, and the variants not loaded are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import build_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.config import CheckpointQuantization, EngineConfig, ModelConfig
from mini_infer.distributed.comm import Comm
from mini_infer.distributed.shard import make_shard
from mini_infer.model import prequantized
from mini_infer.model.loader import load_weights
from mini_infer.model.ops import Ops
from mini_infer.model.qwen2 import Qwen2ForCausalLM
from prequant_checkpoints import PROJECTIONS, quantize_layer, reference_dequantize, write_quantized

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the native kernels need AVX2 + FMA")

CASES = {
    "gptq-int4-g32": dict(method="gptq", bits=4, group_size=32),
    "gptq-int4-g128-asym-v2": dict(method="gptq", bits=4, group_size=128, sym=False, v1=False),  # partial groups
    "gptq-int4-act-order": dict(method="gptq", bits=4, group_size=32, desc_act=True),
    "gptq-int8-g32": dict(method="gptq", bits=8, group_size=32),
    "gptq-int8-per-row": dict(method="gptq", bits=8, group_size=-1),
    "awq-int4-g32": dict(method="awq", bits=4, group_size=32, sym=False),
    "awq-int4-g128": dict(method="awq", bits=4, group_size=128, sym=False),
}


def _model(seed: int):
    return build_hf_model(seed=seed, vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=160, tie_word_embeddings=seed % 2 == 0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (directory, reference weights, the HF float64 model of exactly those weights)."""
    made = {}
    for seed, (case, settings) in enumerate(CASES.items()):
        model = _model(seed)
        path, reference = write_quantized(model, tmp_path_factory.mktemp(case) / "model", seed=seed, **settings)
        made[case] = (str(path), reference, model)
    return made


def _loaded(path: str) -> Qwen2ForCausalLM:
    config = ModelConfig.from_dir(path)
    model = Qwen2ForCausalLM(config, dtype=torch.float32, device="cpu", max_positions=64, ops=Ops(False, "test"),
                             shard=make_shard(config), comm=Comm(make_shard(config)))
    load_weights(model, config, __import__("pathlib").Path(path))
    return model


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_loads_to_exactly_the_weights_the_format_stands_for(checkpoints, case):
    path, reference, _ = checkpoints[case]
    model = _loaded(path)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        fused = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "down_proj": ("mlp.down_proj",)}
        for attr, names in fused.items():
            module = layer.self_attn if attr in ("qkv_proj", "o_proj") else layer.mlp
            weight = getattr(module, attr)
            assert weight.bits == CASES[case]["bits"]
            assert torch.equal(weight.dequantize(), torch.cat([reference[p + n] for n in names]))
    if CASES[case].get("desc_act"):
        assert model.layers[0].self_attn.qkv_proj.perm is not None
    if CASES[case]["method"] == "gptq" and CASES[case].get("sym", True) and CASES[case]["bits"] == 4:
        assert model.layers[0].mlp.down_proj.zeros is None  # symmetric: every zero point 8, none stored


@pytest.mark.parametrize("bits,group_size,in_features", [(4, -1, 1024), (4, 1024, 1280), (8, -1, 1536)])
def test_groups_larger_than_the_kernel_takes_repeat_their_scales(bits, group_size, in_features):
    """One scale per row (or a group over 512 inputs) is split into groups the kernel takes, the same numbers."""
    weight = torch.randn(24, in_features, generator=torch.Generator().manual_seed(in_features))
    stored = quantize_layer(weight, "gptq", bits, group_size, sym=False if bits == 4 else True, perm=None)
    quant = CheckpointQuantization("gptq", bits, group_size, zero_offset=1)
    qt = prequantized.unpack(quant, stored, 24, in_features, "test")
    assert qt.group <= prequantized.MAX_GROUP and qt.group % 8 == 0
    assert torch.equal(qt.dequantize(), reference_dequantize("gptq", stored, bits, group_size, in_features))


def _logprobs(llm_or_model, prompts, params):
    return [o.outputs[0] for o in llm_or_model.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7, 7, 7], list(range(100, 160)), [42] * 20]


@pytest.mark.parametrize("case", ["gptq-int4-g32", "gptq-int4-act-order", "gptq-int8-per-row", "awq-int4-g128"])
def test_logprobs_equal_the_float64_model_of_the_dequantised_weights(checkpoints, case):
    """The engine (float32 activations on the quantised kernel) decodes greedily; HF's float64 model of the
    dequantised weights, fed the same tokens, agrees on every chosen token's logprob and ranks it first, within the
    kernel's rounding: it rounds x to int16 per group (2^-16 of the group's largest |x|, 256x float32's 2^-24), and
    the float32 engine on the float checkpoint of these weights agrees to 4e-6 here, so 1e-3 is that error 256 times
    (measured: up to 1.2e-3); the bound is 3e-3."""
    path, _, model = checkpoints[case]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm = LLM(path, dtype="float32", cpu_kernels="on")
    for prompt, out in zip(PROMPTS, _logprobs(llm, PROMPTS, params)):
        ids = torch.tensor([prompt + list(out.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1: -1].double()
        reference = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(out.token_ids):
            ours = out.logprobs[step][token].logprob
            assert abs(ours - reference[step, token].item()) < 3e-3
            assert reference[step, token] >= reference[step].max() - 6e-3  # a greedy choice for float64 too


@pytest.mark.parametrize("case", ["gptq-int4-act-order", "awq-int4-g32", "gptq-int8-g32"])
def test_prequantised_engine_batches_preempts_caches_and_chunks_as_each_request_alone(checkpoints, case):
    path = checkpoints[case][0]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # one kernel path for every batch size (the autotuner's choices and their batch invariance: test_deterministic.py)
    single = LLM(path, dtype="bfloat16", enable_prefix_caching=False, cpu_kernels="on")
    expected = [_logprobs(single, [p], greedy)[0].token_ids for p in PROMPTS]
    llm = LLM(path, dtype="bfloat16", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, cpu_kernels="on")
    for _ in range(2):
        assert [o.token_ids for o in _logprobs(llm, PROMPTS, greedy)] == expected
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.prefix_hits > 0
    assert engine.kv_cache.num_free_blocks == 40


def test_prequantised_decoder_stack_equals_the_per_op_path(checkpoints, monkeypatch):
    """The one-call decode step reads act-order columns (perm) as the per-op path does: same tokens, logprobs."""
    from mini_infer.kernels.decoder import DecoderStack

    path = checkpoints["gptq-int4-act-order"][0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run():
        out = _logprobs(LLM(path, dtype="float32", cpu_kernels="on"), PROMPTS[:3], params)
        return [(o.token_ids, o.logprobs) for o in out]

    calls = []
    stack_call = DecoderStack.__call__
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *a: calls.append(1) or stack_call(self, *a))
    stacked = run()
    assert calls
    monkeypatch.setattr(Qwen2ForCausalLM, "_decoder_stack", lambda *args: None)
    assert run() == stacked


def test_auto_dtype_runs_a_float16_checkpoint_in_bfloat16_and_keeps_the_head_float(checkpoints):
    path = checkpoints["awq-int4-g32"][0]
    llm = LLM(path)
    stats = llm.engine.memory_stats()[0]
    assert llm.engine.config.torch_dtype == torch.bfloat16 and llm.engine.config.quantization == "awq"
    assert "awq weights" in stats["kernels"]
    model = llm.engine.runner.model
    assert "quant" not in model.lm_head.packed and model.layers[0].mlp.down_proj.packed["quant"].bits == 4


def _config_with(path, tmp_path, **quant):
    target = tmp_path / "model"
    shutil.copytree(path, target)
    raw = json.loads((target / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **quant}
    (target / "config.json").write_text(json.dumps(raw))
    return str(target)


@pytest.mark.parametrize("case,quant,message", [
    ("gptq-int4-g32", dict(quant_method="exl2"), "quant_method 'exl2' \\(exllama v2's EXL2 format\\) is not supported"),
    ("gptq-int4-g32", dict(checkpoint_format="marlin"), "checkpoint_format 'marlin' \\(Marlin's packing\\)"),
    ("gptq-int4-g32", dict(is_marlin_format=True), "checkpoint_format 'marlin'"),
    ("gptq-int4-g32", dict(quant_method="bitsandbytes"), "'bitsandbytes' \\(bitsandbytes\\) is not supported"),
    ("gptq-int4-g32", dict(bits=3), "bits must be one of 4, 8 for gptq, got 3"),
    ("gptq-int4-g32", dict(group_size=100), "group_size must be -1 or a positive multiple of 8, got 100"),
    ("gptq-int8-g32", dict(sym=False), "sym False with 8 bits .* is not supported"),
    ("gptq-int4-g32", dict(lm_head=True), "lm_head true"),
    ("awq-int4-g32", dict(version="gemv"), "version 'gemv' \\(GEMV packing\\) is not supported"),
    ("awq-int4-g32", dict(version="exllama"), "version 'exllama' \\(ExLlama's packing\\)"),
    ("awq-int4-g32", dict(bits=8), "bits must be one of 4 for awq, got 8"),
    ("awq-int4-g32", dict(zero_point=False), "zero_point must be true"),
])
def test_unsupported_variants_are_refused_by_name(checkpoints, tmp_path, case, quant, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(_config_with(checkpoints[case][0], tmp_path, **quant))


@pytest.mark.parametrize("settings,message", [
    (dict(quantization="int4"), "quantization must be None or 'gptq' for this checkpoint"),
    (dict(quantization="awq"), "quantization must be None or 'gptq'"),
    (dict(dtype="float16"), "runs bfloat16 or float32 activations on the CPU, not dtype torch.float16"),
    (dict(cpu_kernels="off"), "cpu_kernels must be 'auto' or 'on', not 'off'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size must be 1 for a gptq checkpoint"),
])
def test_engine_refuses_what_a_prequantised_checkpoint_cannot_run_with(checkpoints, settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=checkpoints["gptq-int4-g32"][0], **settings)


def test_gptq_flag_on_a_float_checkpoint_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization 'gptq' loads a GPTQ checkpoint, but .* no quantization_config"):
        EngineConfig(model=str(tiny_model_dir), quantization="gptq")


def test_a_missing_act_order_g_idx_and_a_wrong_dtype_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _config_with(checkpoints["gptq-int4-act-order"][0], tmp_path)
    tensors = load_file(f"{path}/model.safetensors")
    name = f"model.layers.1.{PROJECTIONS[3]}.g_idx"
    del tensors[name]
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensors: {name}"):
        LLM(path)
    tensors[name] = torch.zeros(64, dtype=torch.int32)
    tensors["model.layers.0.mlp.up_proj.qweight"] = tensors["model.layers.0.mlp.up_proj.qweight"].float()
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.qweight' is torch.float32, expected torch.int32"):
        LLM(path)


def test_pipeline_stages_load_their_layers_of_a_prequantised_checkpoint(checkpoints):
    """Two pipeline stages, each loading (and unpacking) only its own layer, give the single process's tokens."""
    import os

    from conftest import descendants

    path = checkpoints["gptq-int4-act-order"][0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # one kernel path, not the autotuner's choice (each stage's process would time every path again: minutes)
    expected = [o.token_ids for o in _logprobs(LLM(path, dtype="float32", cpu_kernels="on"), PROMPTS[:3], greedy)]
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2, cpu_kernels="on")
    try:
        assert [o.token_ids for o in _logprobs(llm, PROMPTS[:3], greedy)] == expected
    finally:
        llm.engine.shutdown()
    assert descendants(os.getpid()) == []
