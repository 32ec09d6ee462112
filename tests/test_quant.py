"""Weight-only quantisation (kernels/quant.py, cpu_gemm_quant.cpp): the quantisers' error bounds, every kernel path
and torch's int4 matmul against a float64 matmul by the dequantised weights, and quantised engines that batch,
preempt, cache prefixes and chunk prefills without changing a request's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import build_hf_model, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.config import EngineConfig
from mini_infer.kernels import quant

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the native kernels need AVX2 + FMA")

PATHS = tuple(quant.QUANT_KERNELS)
METHODS = ("int8", "int4")
# Two-level schemes as the GGUF K-quants load: Q4_K (int4 with mins, 8 groups of 32 a super-block), Q5_K (its 5-bit
# q in bytes, with mins), Q6_K (int8 without mins, 16 groups of 16).
TWO_LEVEL = {"q4_k": quant.Scheme(4, 32, True, torch.float16, 8), "q5_k": quant.Scheme(8, 32, True, torch.float16, 8),
             "q6_k": quant.Scheme(6, 16, False, torch.float16, 16)}


def skip_unless_runs(path: str) -> None:
    why = quant.quant_paths()[path]
    if why is not None:
        pytest.skip(f"the {path} quantised matmul does not run here: {why}")


def dtypes(path: str) -> tuple[torch.dtype, ...]:
    """The activation dtypes that `path` multiplies (the AMX build: bfloat16 only)."""
    return (torch.bfloat16,) if path in quant.BF16_ONLY else (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols,inner", [(5, 32), (33, 70), (64, 128)])
def test_round_trip_error_is_within_half_a_step(method, scale_dtype, cols, inner):
    """Each weight dequantises to within half a quantisation step of its group (plus the scale's rounding to its
    dtype, which can push int8's largest weight one clamp past 127 steps; int4's weights clamped at q = 15 a whole
    step), and the integers stay in range."""
    gen = torch.Generator().manual_seed(cols * inner)
    weight = torch.randn(cols, inner, generator=gen) * torch.rand(cols, 1, generator=gen) * 3
    weight[0, :8] = 0.0  # part of a group at zero
    qt = quant.quantize(weight, method, scale_dtype)
    group = quant.GROUP_SIZE[method]
    assert qt.q.shape == (cols, -(-inner // group) * group) and qt.group == group
    steps = qt.scales.repeat_interleave(group, dim=1)[:, :inner]
    error = (qt.dequantize() - weight).abs()
    if method == "int8":
        assert qt.q.dtype == torch.int8 and int(qt.q.abs().max()) <= 127 and qt.zeros is None
        amax = weight.abs().view(cols, -1, group).amax(-1) if inner % group == 0 else None
        slack = 0 if scale_dtype == torch.float32 else steps * 127 * 2 ** -8  # bf16 scale below amax / 127
        assert (error <= steps / 2 + slack + 1e-6).all()
        if amax is not None and scale_dtype == torch.float32:
            assert torch.allclose(qt.scales, amax / 127)
    else:
        # llama.cpp's Q4_0 rule: scale = (the group's largest |w|, signed) / -8, so that weight is q = 0 exactly and
        # the others round to the nearest step, bar those past 7.5 steps on the other side, clamped to q = 15
        assert qt.q.dtype == torch.uint8 and int(qt.q.max()) <= 15 and qt.zeros is None
        steps = steps.abs()
        clamped = (weight / qt.scales.repeat_interleave(group, dim=1)[:, :inner]) > 7.5
        slack = 0 if scale_dtype == torch.float32 else steps * 8 * 2 ** -8  # a bf16 scale off by up to 2^-9
        assert (error <= torch.where(clamped, steps, steps / 2) + slack + 1e-6).all()
        if scale_dtype == torch.float32:
            largest = weight.abs().argmax(dim=1)
            assert torch.equal(qt.dequantize()[torch.arange(cols), largest], weight[torch.arange(cols), largest])
    assert torch.equal(qt.scales.to(scale_dtype).float(), qt.scales)  # held exactly in scale_dtype


@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("cols,inner", [(5, 32), (33, 300), (16, 512)])
def test_two_level_scales_are_integers_under_float16_ones(name, cols, inner):
    """A two-level quantisation (the K-quants' form): int8 sub-scales and mins under float16 ones per super-block, K
    padded to whole super-blocks, integers in their range, and each weight within one step of its group (sub-scales
    are rounded up, so a step is at most a little wider than the group needs)."""
    scheme = TWO_LEVEL[name]
    gen = torch.Generator().manual_seed(cols + inner)
    weight = torch.randn(cols, inner, generator=gen) * torch.rand(cols, 1, generator=gen) * 3
    weight[0, :8] = 0.0
    qt = quant.quantize(weight, scheme, torch.float32)
    unit = scheme.group * scheme.super_groups
    padded = -(-inner // unit) * unit
    assert qt.scheme == scheme and qt.q.shape == (cols, padded)
    assert qt.super_scales.dtype == torch.float16 and qt.super_scales.shape == (cols, padded // unit)
    assert qt.scales.dtype == torch.int8 and qt.scales.shape == (cols, padded // scheme.group)
    assert int(qt.scales.min()) >= 0 and (qt.zeros is not None) == scheme.zeros == (qt.super_mins is not None)
    low, high = (0, 15) if scheme.bits == 4 else ((0, 127) if scheme.zeros else (-127, 127))
    assert low <= int(qt.q.min()) and int(qt.q.max()) <= high
    step = (qt.super_scales.float().repeat_interleave(scheme.super_groups, dim=1) * qt.scales.float())
    step = step.repeat_interleave(scheme.group, dim=1)[:, :inner]
    mins_step = 0
    if scheme.zeros:
        mins_step = qt.super_mins.float().repeat_interleave(scheme.super_groups * scheme.group, dim=1)[:, :inner]
    assert ((qt.dequantize() - weight).abs() <= step / 2 + mins_step / 2 + 1e-6).all()


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        quant.quantize(torch.ones(4, 4), "int3", torch.float32)


# M: 1-7 rows (the tile shapes, 4-row tiles with each remainder), more; N: whole and partial panels, groups with
# remainders; K: whole groups and K padded up to the group (x reads zeros there).
SHAPES = [(1, 7, 32), (1, 200, 64), (1, 130, 896), (2, 50, 96), (3, 33, 40), (4, 90, 128), (5, 17, 200), (6, 40, 96),
          (7, 21, 64), (9, 300, 70), (16, 64, 256), (33, 48, 36)]


def reference_and_bound(x: torch.Tensor, qt: quant.QuantizedTensor, bias: torch.Tensor | None):
    """The float64 product by the dequantised weights, and how far the kernel may be from it: x is rounded to int16
    per group of the weight's (at most half of 2^-15 of the group's largest |x| per element), then float32 sums."""
    weight = qt.dequantize().double()
    xd = x.double()
    expected = xd @ weight.T + (bias.double() if bias is not None else 0)
    group = qt.group
    padded = torch.nn.functional.pad(xd, (0, qt.q.shape[1] - x.shape[1]))
    largest = padded.abs().view(x.shape[0], -1, group).amax(-1).repeat_interleave(group, dim=1)[:, : x.shape[1]]
    rounding = (largest * 2.0 ** -15) @ weight.abs().T
    float_error = (xd.abs() @ weight.abs().T + 1) * x.shape[1] * 2.0 ** -22
    return expected, rounding + float_error


# The kernel's schemes: the two quantised at load, int4 with zero points (GPTQ / AWQ checkpoints), the K-quants'.
KERNEL_SCHEMES = (*METHODS, "int4-zeros", *TWO_LEVEL)


def quantized(weight: torch.Tensor, scheme: str, dtype: torch.dtype) -> quant.QuantizedTensor:
    if scheme in TWO_LEVEL:
        return quant.quantize(weight, TWO_LEVEL[scheme], torch.float32)
    if scheme == "int4-zeros":
        return quant.quantize(weight, quant.Scheme(4, 32, True, quant.scale_dtype(dtype)), quant.scale_dtype(dtype))
    return quant.quantize(weight, scheme, quant.scale_dtype(dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", KERNEL_SCHEMES)
@pytest.mark.parametrize("rows,cols,inner", SHAPES)
def test_kernel_matches_float64_matmul_by_the_dequantised_weights(path, method, rows, cols, inner):
    skip_unless_runs(path)
    gen = torch.Generator().manual_seed(rows * 1000 + cols * 10 + inner)
    for dtype in dtypes(path):
        x = torch.randn(rows, inner, generator=gen).to(dtype)
        x[0, : min(inner, 5)] *= 40  # a row whose groups span very different magnitudes
        qt = quantized(torch.randn(cols, inner, generator=gen), method, dtype)
        bias = torch.randn(cols, generator=gen).to(dtype) if rows % 2 else None
        out = quant.quant_linear(x, quant.pack_panels(qt), bias, path)
        assert out.dtype == dtype and out.shape == (rows, cols)
        expected, bound = reference_and_bound(x, qt, bias)
        if dtype == torch.bfloat16:
            bound = bound + expected.abs() * 2 ** -8  # the output's rounding to bf16
        assert ((out.double() - expected).abs() <= bound).all(), (out.double() - expected).abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_kernel_rows_are_independent_of_the_batch(path):
    """A row's result is the same bits whichever rows share the call (tile shapes differ with the row count): what
    lets a quantised engine batch without changing a request's tokens."""
    skip_unless_runs(path)
    gen = torch.Generator().manual_seed(3)
    dtype = dtypes(path)[0]
    for method in KERNEL_SCHEMES:
        packed = quant.pack_panels(quantized(torch.randn(70, 100, generator=gen), method, dtype))
        x = torch.randn(37, 100, generator=gen).to(dtype)
        together = quant.quant_linear(x, packed, None, path)
        for rows in (slice(0, 1), slice(3, 5), slice(2, 9), slice(4, 37)):
            assert torch.equal(quant.quant_linear(x[rows], packed, None, path), together[rows])


@pytest.mark.parametrize("path", PATHS)
def test_kernel_writes_into_a_given_buffer_what_it_returns_fresh(path):
    """`out` (a quantised LM head writing into the runner's reused logits buffer): the same bits, in that storage;
    a buffer of another shape is refused by name."""
    skip_unless_runs(path)
    gen = torch.Generator().manual_seed(4)
    dtype = dtypes(path)[0]
    packed = quant.pack_panels(quantized(torch.randn(70, 64, generator=gen), KERNEL_SCHEMES[0], dtype))
    x = torch.randn(5, 64, generator=gen).to(dtype)
    buffer = torch.empty(8, 70, dtype=dtype)
    out = quant.quant_linear(x, packed, None, path, out=buffer[:5])
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(out, quant.quant_linear(x, packed, None, path))
    with pytest.raises(ValueError, match=r"quantised linear: out \(4, 70\)"):
        quant.quant_linear(x, packed, None, path, out=buffer[:4])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", KERNEL_SCHEMES)
def test_grouped_kernel_gives_each_weights_rows_as_its_own_call(path, method):
    """quant_linear_grouped (a mixture's experts in one call): each weight's rows come out bit for bit as
    quant_linear gives them, whatever the groups' sizes (1 to 9 rows, an empty one, panels shared unevenly among
    the threads), in float32 and bfloat16."""
    skip_unless_runs(path)
    gen = torch.Generator().manual_seed(11)
    for dtype in dtypes(path):
        weights = [quant.pack_panels(quantized(torch.randn(70, 100, generator=gen), method, dtype)) for _ in range(5)]
        offsets = [0, 1, 4, 4, 13, 15]  # rows 1, 3, 0, 9, 2
        x = torch.randn(offsets[-1], 100, generator=gen).to(dtype)
        out = quant.quant_linear_grouped(x, weights, offsets, path)
        for weight, a, b in zip(weights, offsets, offsets[1:]):
            if b > a:
                assert torch.equal(out[a:b], quant.quant_linear(x[a:b], weight, None, path))


def test_amx_path_refuses_float32_activations():
    """The AMX build multiplies x as it is, in bf16 tiles: a float32 x is refused (never rounded), and the path is
    no candidate for a float32 model."""
    assert "bfloat16 activations only" in quant.quant_paths(torch.float32)["amx_bf16"]
    skip_unless_runs("amx_bf16")
    packed = quant.pack_panels(quant.quantize(torch.randn(16, 64), "int4", torch.float32))
    with pytest.raises(ValueError, match="bfloat16 activations only, not torch.float32"):
        quant.quant_linear(torch.randn(2, 64), packed, None, "amx_bf16")
    with pytest.raises(ValueError, match="bfloat16 activations only, not torch.float32"):
        quant.quant_linear_grouped(torch.randn(2, 64), [packed], [0, 2], "amx_bf16")


def test_grouped_kernel_refuses_weights_unlike_the_first():
    gen = torch.Generator().manual_seed(12)
    int8, int4 = (quant.pack_panels(quantized(torch.randn(70, 100, generator=gen), m, torch.float32))
                  for m in ("int8", "int4"))
    with pytest.raises(ValueError, match="does not match 2 weights like int8 70 x 100"):
        quant.quant_linear_grouped(torch.randn(3, 100), [int8, int4], [0, 1, 3])
    with pytest.raises(ValueError, match="offsets"):
        quant.quant_linear_grouped(torch.randn(3, 100), [int8, int8], [0, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int4_matmul_computes_the_same_weights(dtype):
    gen = torch.Generator().manual_seed(5)
    qt = quant.quantize(torch.randn(40, 70, generator=gen), "int4", quant.scale_dtype(dtype))
    assert quant.torch_int4_available(qt.scheme, dtype) is None
    x = torch.randn(3, 70, generator=gen).to(dtype)
    out = quant.torch_int4_linear(x, quant.pack_torch_int4(qt, dtype))
    expected = x.double() @ qt.dequantize().double().T
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.shape == (3, 40)
    assert (out.double() - expected).abs().max() <= tolerance * (expected.abs().max() + 1)


def test_torch_int4_refuses_what_it_would_round_and_int8_groups():
    qt = quant.quantize(torch.randn(16, 32), "int4", torch.float32)
    assert "round" in quant.torch_int4_available(qt.scheme, torch.bfloat16)  # float32 scales, bf16 activations
    assert quant.torch_int4_available(quant.Scheme(4, 32, False, torch.float16), torch.float32) is None
    assert "groups of 32, 64, 128 or 256, not 512" in quant.torch_int4_available(
        quant.Scheme(4, 512, True, torch.float32), torch.float32)
    assert "int8" in quant.torch_int4_available(quant.method_scheme("int8", torch.float32), torch.float32)
    assert "one level" in quant.torch_int4_available(TWO_LEVEL["q4_k"], torch.float32)
    with pytest.raises(ValueError, match="round"):
        quant.pack_torch_int4(qt, torch.bfloat16)


@pytest.mark.parametrize("bits,group,zeros,scale_dtype,super_groups", [
    (3, 32, False, torch.float32, 0), (8, 30, False, torch.float32, 0), (4, 1024, False, torch.float32, 0),
    (8, 32, False, torch.float16, 0),  # one level of float16 scales
    (8, 32, False, torch.float32, 8),  # two levels whose top is not float16
    (4, 32, False, torch.float16, 8),  # two-level int4 without mins
    (6, 16, False, torch.float32, 0),  # int6 in one level
    (6, 16, True, torch.float16, 16),  # two-level int6 with mins
])
def test_kernel_refuses_what_it_has_no_layout_for(bits, group, zeros, scale_dtype, super_groups):
    skip_unless_runs("avx2")
    packed = quant.pack_panels(quant.quantize(torch.randn(16, 256), "int8", torch.float32))
    bad = quant.QuantPanels(packed.data, scale_dtype, zeros, bits, group, 16, 256, None, super_groups)
    with pytest.raises(ValueError, match="refused"):
        quant.quant_linear(torch.randn(1, 256), bad)


@pytest.mark.parametrize("method", KERNEL_SCHEMES)
def test_random_timing_weights_are_of_the_scheme_and_run(method):
    """The autotuner's timing data (quant.random_quantized: integers and scales drawn without a float weight) has
    the scheme of the weights it stands for, its integers in that scheme's range, and packs into a layout the
    kernel runs (as the scheme's own weights of that shape)."""
    skip_unless_runs("avx2")
    scheme = quantized(torch.randn(40, 512), method, torch.float32).scheme
    qt = quant.random_quantized(scheme, 40, 500, torch.Generator().manual_seed(0))
    assert qt.scheme == scheme and qt.in_features == 500 and qt.q.shape == (40, 512)
    low, high = {4: (0, 15), 6: (-32, 31), 8: (0 if scheme.super_groups and scheme.zeros else -127, 127)}[scheme.bits]
    assert int(qt.q.min()) == low and int(qt.q.max()) == high
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    out = quant.quant_linear(x, quant.pack_panels(qt), None, "avx2")
    expected, bound = reference_and_bound(x, qt, None)  # within the kernel's int16 rounding of x, as every scheme
    assert ((out.double() - expected).abs() <= bound).all(), (out.double() - expected).abs().max()


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    model = build_hf_model(seed=7, vocab_size=500, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                           intermediate_size=200, tie_word_embeddings=True)
    return str(save_hf_model(model.to(torch.float32), tmp_path_factory.mktemp("quant") / "model"))


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7, 7, 7], list(range(100, 160)), [42] * 20]


def alone(path: str, method: str) -> list[list[int]]:
    llm = LLM(path, dtype="float32", quantization=method, cpu_kernels="on", enable_prefix_caching=False)
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in PROMPTS]


@pytest.mark.parametrize("method", METHODS)
def test_quantised_engine_batches_preempts_caches_and_chunks_as_each_request_alone(quant_model, method):
    expected = alone(quant_model, method)
    # 40 blocks of 4 force preemption; 16-token steps chunk every long prompt; the second wave hits the prefix cache.
    llm = LLM(quant_model, dtype="float32", quantization=method, cpu_kernels="on", block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=16)
    for wave in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.prefix_hits > 0
    assert engine.kv_cache.num_free_blocks == 40


def test_quantised_weights_replace_the_float_ones(tmp_path):
    """Every projection and the LM head (a tied one too: its own quantised copy) is quantised; the embedding stays. A
    model whose every output size is a multiple of 16 (no padded panels): int4 layers hold 4 bits and a float32
    scale per 32 weights (5 bits), the int8 head 8 + 1 bits, against float32's 32."""
    model = build_hf_model(seed=3, vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=256, tie_word_embeddings=True)
    path = str(save_hf_model(model.to(torch.float32), tmp_path / "model"))
    stats = LLM(path, dtype="float32", quantization="int4", cpu_kernels="on").engine.memory_stats()[0]
    plain = LLM(path, dtype="float32", cpu_kernels="on").engine.memory_stats()[0]
    assert "int4 weights, LM head int8" in stats["kernels"]
    norms_and_biases = 4 * (2 * (2 * 128 + 256) + 128)
    embedding = 512 * 128 * 4
    layers, head = 2 * (256 * 128 + 128 * 128 + 512 * 128 + 128 * 256), 512 * 128
    quantised = stats["param_bytes"] - embedding - norms_and_biases
    assert quantised == layers * 5 // 8 + head * 9 // 8
    assert plain["param_bytes"] - embedding - norms_and_biases == 4 * (layers + head)  # the packed float head


def test_quantised_decoder_stack_equals_the_per_op_path(quant_model, monkeypatch):
    """The one-call decode step (kernels/decoder.py) runs the quantised kernels as the per-op path does: same tokens
    and the same logprobs."""
    from mini_infer.kernels.decoder import DecoderStack
    from mini_infer.model.qwen2 import Qwen2ForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(quant_model, dtype="float32", quantization="int8", cpu_kernels="on")
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]

    calls = []
    stack_call = DecoderStack.__call__
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *a: calls.append(1) or stack_call(self, *a))
    stacked = run()
    assert calls  # the decode steps ran through the stack
    monkeypatch.setattr(Qwen2ForCausalLM, "_decoder_stack", lambda *args: None)
    assert run() == stacked


@pytest.mark.parametrize("settings,message", [
    (dict(quantization="int3"), "quantization must be one of int8, int4"),
    (dict(quantization="int8", cpu_kernels="off"), "int8' runs on mini-infer's native kernels only"),
    (dict(quantization="int8", dtype="float16"), "int8' runs on mini-infer's native kernels only"),
    (dict(quantization="int4", dtype="float64"), "runs bfloat16, float16 or float32 models on the CPU"),
])
def test_config_refuses_what_cannot_run(quant_model, settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=quant_model, **settings)


def test_int4_without_native_kernels_runs_torchs_int4_matmul(quant_model):
    llm = LLM(quant_model, dtype="float32", quantization="int4", cpu_kernels="off")
    assert "torch's int4 matmul" in llm.engine.memory_stats()[0]["kernels"]
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 10


@pytest.mark.parametrize("method,kernels,head_bits", [("int8", "on", 8), ("int4", "on", 8), ("int4", "auto", 8),
                                                      ("int4", "off", 4)])
def test_the_lm_head_is_int8_where_the_native_kernels_run(quant_model, method, kernels, head_bits):
    """int4 models keep the (tied) LM head in int8 (quant.HEAD_METHOD); torch's int4 matmul has no int8 one."""
    model = LLM(quant_model, dtype="float32", quantization=method, cpu_kernels=kernels).engine.runner.model
    layer_bits = {"int8": 8, "int4": 4}[method]

    def bits(weight):
        packed = weight.packed.get("quant")
        return packed.bits if packed is not None else 4  # torch's int4 form

    assert bits(model.lm_head) == head_bits and bits(model.layers[0].mlp.down_proj) == layer_bits
    assert model.embed_tokens.dtype == torch.float32  # the embedding lookup stays in the model's dtype


def test_bench_quantization_flag_adds_the_quantised_systems_beside_their_bases():
    import argparse

    from mini_infer.bench.options import BenchOptions, add_bench_args

    def options(*flags):
        parser = argparse.ArgumentParser()
        add_bench_args(parser)
        return BenchOptions.from_args(parser.parse_args(list(flags)))

    both = options("--systems", "mini-infer,llama.cpp", "--quantization", "int8,int4")
    assert both.systems == ("mini-infer", "llama.cpp", "mini-infer-int8", "mini-infer-int4", "llama.cpp-q8_0",
                            "llama.cpp-q4_0")
    assert options("--systems", "mini-infer", "--quantization", "int4").systems == ("mini-infer", "mini-infer-int4")
    with pytest.raises(ValueError, match="--quantization must be a comma list of int8, int4"):
        options("--quantization", "int2")


def test_kl_divergence_of_known_distributions():
    from mini_infer.bench.kl import divergence

    base = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]], dtype=torch.float64))
    other = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.6, 0.3]], dtype=torch.float64))
    kl, same = divergence(base, other)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5)) and kl[1].item() == 0.0
    assert same.tolist() == [False, True]


def test_kl_workload_scores_each_quantised_engine_against_the_unquantised_one(tiny_model_dir, short_kl_workload):
    """The tiny preset (real vocabulary) over the text's first half: two chunks of 512 (the fewest the workload
    takes), 255 positions each; int4 strays further than int8 from the float32 model, and neither is exactly it."""
    import argparse

    from mini_infer.bench.kl import KL, run_kl
    from mini_infer.bench.options import BenchOptions, add_bench_args
    from mini_infer.bench.run import table

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    options = BenchOptions.from_args(parser.parse_args(["--workload", "kl", "--systems", "mini-infer", "--dtype",
                                                        "float32", "--quantization", "int8,int4"]))
    report = run_kl(options, str(tiny_model_dir), lambda message: None)
    int8, int4 = report["systems"]["mini-infer-int8"], report["systems"]["mini-infer-int4"]
    assert report["config"]["chunks"] == 2 and int8["positions"] == int4["positions"] == 2 * 255
    assert 0 < int8["mean_kl"] < int4["mean_kl"]
    assert int8["top1_same_pct"] >= int4["top1_same_pct"]
    text = table(KL, {**report, "machine": {"torch_threads": 2, "cpu_cores": 2, "cpu_model": "test",
                                            "load_average_1m": 0.0}})
    assert "mini-infer-int8" in text and "mean KL" in text

