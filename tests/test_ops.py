"""Which kernels the model runs: what `auto` picks, what `on` refuses, and no silent fallback."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mini_infer import SamplingParams, machine
from mini_infer.config import EngineConfig
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels import cpu, quant
from mini_infer.kernels.autotune import machine_key
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
    """The AVX-512F build broken (a compiler flag it rejects): auto times the paths that remain, its note says which
    path is missing and why, and `on` takes the best remaining one."""
    broken = dataclasses.replace(cpu._KERNELS["gemm_avx512"], flags=["-mno-such-instruction-set"],
                                 needs=("avx2",))
    monkeypatch.setitem(cpu._KERNELS, "gemm_avx512", broken)
    monkeypatch.setattr(cpu, "_outcomes", {})
    paths = cpu.matmul_paths(torch.float32)
    assert paths["avx2"] is None and "failed to build cpu_gemm_avx512.cpp" in paths["avx512"]
    chosen = select_ops("auto", torch.float32, "cpu")
    assert chosen.tuner.candidates == ("avx2", "torch")
    assert "not here: avx512: g++ failed to build cpu_gemm_avx512.cpp" in chosen.note
    assert select_ops("on", torch.float32, "cpu").path == "avx2"


@needs_kernels
def test_a_failed_build_is_remembered_with_its_reason(monkeypatch):
    """A kernel that failed to build is not built again on the next lookup: the same reason comes back."""
    broken = dataclasses.replace(cpu._KERNELS["gemm_avx512"], flags=["-mno-such-instruction-set"], needs=("avx2",))
    monkeypatch.setitem(cpu._KERNELS, "gemm_avx512", broken)
    monkeypatch.setattr(cpu, "_outcomes", {})
    builds = []
    real_build = cpu.build_library
    monkeypatch.setattr(cpu, "build_library",
                        lambda *args, **kwargs: builds.append(args) or real_build(*args, **kwargs))
    reasons = [cpu.kernel_reason("gemm_avx512") for _ in range(3)]
    assert len(builds) == 1 and reasons[0] == reasons[2] and "failed to build" in reasons[0]


@needs_kernels
def test_an_optional_kernel_that_fails_drops_only_its_own_job(monkeypatch, tiny_model_dir):
    """argmax_rows broken: the native kernels still run, greedy sampling takes torch's argmax (the same ids), and
    the note names what is missing."""
    broken = dataclasses.replace(cpu._KERNELS["argmax_rows"], flags=["-mno-such-instruction-set"])
    monkeypatch.setitem(cpu._KERNELS, "argmax_rows", broken)
    monkeypatch.setattr(cpu, "_outcomes", {})
    chosen = select_ops("on", torch.float32, "cpu")
    assert chosen.native and not chosen.runs("argmax_rows") and chosen.runs("top_k_rows")
    assert "argmax_rows: g++ failed to build cpu_fused.cpp" in chosen.note
    logits = torch.randn(3, 50)
    assert torch.equal(chosen.argmax(logits), logits.argmax(dim=-1))
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", cpu_kernels="on")
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    assert [len(o.outputs[0].token_ids) for o in engine.run_until_done() if o.finished] == [3]
    assert cpu.unavailable_reason() is None


def test_a_path_the_cpu_lacks_is_named(monkeypatch):
    monkeypatch.setattr(machine, "cpu", lambda: machine.Cpu("a CPU", frozenset({"avx2", "fma"})))
    monkeypatch.setattr(cpu, "_outcomes", {})
    paths = cpu.matmul_paths(torch.bfloat16)
    assert paths["avx512_bf16"] == ("the CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16 (needed by "
                                    "gemm_avx512bf16)")


_CTYPES = {"void": None, "int": ctypes.c_int, "long": ctypes.c_long, "int64_t": ctypes.c_int64,
           "float": ctypes.c_float}


def c_prototype(source: str, function: str) -> tuple[list, object]:
    """The ctypes (argtypes, restype) of `extern "C"` function `function` in kernels/`source`: pointers as
    c_void_p, the rest by their C type."""
    text = (Path(cpu.__file__).parent / source).read_text()
    match = re.search(rf'extern "C" (\w+) {function}\(([^)]*)\)', text)
    assert match, f"{function} not found in {source}"
    params = [" ".join(p.split()) for p in match.group(2).split(",") if p.strip()]
    argtypes = [ctypes.c_void_p if "*" in p else _CTYPES[p.rsplit(" ", 1)[0].removeprefix("const ")] for p in params]
    return argtypes, _CTYPES[match.group(1)]


@pytest.mark.parametrize("name", sorted(cpu._KERNELS))
def test_ctypes_signatures_match_the_c_prototypes(name):
    """A mismatched argument list would crash the process, not raise: each kernel's ctypes signature is read back from
    its C prototype."""
    kernel = cpu._KERNELS[name]
    argtypes, restype = c_prototype(kernel.source, kernel.function)
    assert kernel.argtypes == argtypes and kernel.restype is restype


def test_the_autotune_key_covers_the_kernels_build(monkeypatch):
    """The matmul timings are keyed by the kernels' sources and headers, their flags and the compiler: another
    compiler, flag or header times again (bf16.h is in the quantised kernels' key too)."""
    key = machine_key(torch.bfloat16, cpu.gemm_source())
    assert (Path(cpu.__file__).parent / "bf16.h").read_text() in quant.kernel_source(quant.method_scheme(
        "int8", torch.bfloat16))
    monkeypatch.setattr(cpu, "compiler_version", lambda: "g++\0another 99.1")
    assert machine_key(torch.bfloat16, cpu.gemm_source()) != key
    monkeypatch.undo()
    flagged = dataclasses.replace(cpu._KERNELS["gemm"], flags=[*cpu._KERNELS["gemm"].flags, "-O2"])
    monkeypatch.setitem(cpu._KERNELS, "gemm", flagged)
    assert machine_key(torch.bfloat16, cpu.gemm_source()) != key


def test_the_autotune_key_is_the_same_in_every_process():
    """Timings cached by one process are found by the next: the key does not depend on hash randomisation."""
    script = ("import torch; from mini_infer.kernels import cpu; from mini_infer.kernels.autotune import machine_key; "
              "print(machine_key(torch.bfloat16, cpu.gemm_source()))")
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(keys) == 1 and keys.pop().strip()
