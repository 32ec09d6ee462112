"""Which kernels the model runs: what `auto` picks, what `on` refuses, and no silent fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini_infer.config import EngineConfig
from mini_infer.kernels import cpu
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.model.ops import select_ops

needs_kernels = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                   reason="the native kernels need AVX2 + FMA")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_native_kernels_for_cpu_float32_and_bfloat16(dtype):
    assert select_ops("auto", dtype, "cpu").native


@needs_kernels
def test_prepare_packs_every_linear_weight_and_keeps_a_tied_embedding(tiny_model_dir):
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", cpu_kernels="on")
    model = engine.runner.model
    assert all(isinstance(getattr(module, name), cpu.PackedWeight) for module, name in model.linear_weights())
    assert model.config.tie_word_embeddings and isinstance(model.embed_tokens, torch.nn.Parameter)
    assert "lm_head" not in dict(model.named_parameters())
    unpacked = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", cpu_kernels="off").runner.model
    assert all(isinstance(getattr(module, name), torch.nn.Parameter) for module, name in unpacked.linear_weights())


def test_float64_and_off_run_torch_ops():
    assert not select_ops("auto", torch.float64, "cpu").native
    assert not select_ops("off", torch.float32, "cpu").native


def test_on_refuses_what_the_kernels_cannot_run():
    with pytest.raises(ValueError, match="cpu_kernels 'on' runs bfloat16/float32 models on the CPU, not torch.float64"):
        select_ops("on", torch.float64, "cpu")


def test_unavailable_kernels_are_announced_never_silent(monkeypatch):
    monkeypatch.setattr(cpu, "unavailable_reason", lambda: "no C++ compiler 'g++' on PATH (set CXX)")
    with pytest.warns(UserWarning, match="native CPU kernels unavailable.*no C\\+\\+ compiler"):
        chosen = select_ops("auto", torch.float32, "cpu")
    assert not chosen.native and "unavailable" in chosen.note
    with pytest.raises(ValueError, match="'on' but the native kernels are unavailable: no C\\+\\+ compiler"):
        select_ops("on", torch.float32, "cpu")


def test_engine_config_rejects_unknown_mode(tiny_model_dir):
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, on, off"):
        EngineConfig(model=str(tiny_model_dir), cpu_kernels="fast")


@needs_kernels
def test_a_matmul_path_that_fails_to_build_is_left_out_and_named(monkeypatch):
    """The AVX-512F build broken (a compiler flag it rejects; a failed build caches nothing): auto times the paths
    that remain, its note says which path is missing and why, and `on` takes the best remaining one."""
    broken = dataclasses.replace(cpu._KERNELS["gemm_avx512"], flags=["-mno-such-instruction-set"],
                                 needs=("avx2",))
    monkeypatch.setitem(cpu._KERNELS, "gemm_avx512", broken)
    cpu.native_function.cache_clear()
    try:
        paths = cpu.matmul_paths(torch.float32)
        assert paths["avx2"] is None and "failed to build cpu_gemm_avx512.cpp" in paths["avx512"]
        chosen = select_ops("auto", torch.float32, "cpu")
        assert chosen.tuner.candidates == ("avx2", "torch")
        assert "not here: avx512: g++ failed to build cpu_gemm_avx512.cpp" in chosen.note
        assert select_ops("on", torch.float32, "cpu").path == "avx2"
    finally:
        cpu.native_function.cache_clear()


def test_a_path_the_cpu_lacks_is_named(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    cpu.native_function.cache_clear()
    try:
        paths = cpu.matmul_paths(torch.bfloat16)
        assert paths["avx512_bf16"] == ("the CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16 (needed by "
                                        "gemm_avx512bf16)")
    finally:
        cpu.native_function.cache_clear()
