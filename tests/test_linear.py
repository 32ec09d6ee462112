"""Linear backend selection: what `auto` picks, what explicit choices refuse, and no silent fallback."""

from __future__ import annotations

import pytest
import torch

from mini_infer.config import EngineConfig
from mini_infer.kernels import cpu_gemm
from mini_infer.model import linear
from mini_infer.model.linear import TORCH_NATIVE_ABOVE_ROWS, select_linear_backend

needs_kernel = pytest.mark.skipif(cpu_gemm.unavailable_reason() is not None, reason="cpu_gemm unavailable here")


@needs_kernel
def test_auto_uses_the_kernel_for_decode_sizes_and_native_torch_above():
    backend = select_linear_backend("auto", torch.float32, "cpu")
    assert backend.name == "cpu-gemm" and backend.max_kernel_rows == TORCH_NATIVE_ABOVE_ROWS


@needs_kernel
@pytest.mark.parametrize("native", [True, False])
def test_auto_bfloat16_depends_on_native_bf16_matmul(monkeypatch, native):
    monkeypatch.setattr(linear, "_torch_matmul_native", lambda dtype: native)
    backend = select_linear_backend("auto", torch.bfloat16, "cpu")
    assert backend.name == "cpu-gemm"
    assert backend.max_kernel_rows == (TORCH_NATIVE_ABOVE_ROWS if native else None)


@needs_kernel
def test_rows_above_the_threshold_take_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_gemm, "linear", lambda *args: calls.append("kernel") or torch.zeros(1))
    monkeypatch.setattr(linear.F, "linear", lambda *args: calls.append("torch") or torch.zeros(1))
    backend = select_linear_backend("auto", torch.float32, "cpu")
    weight = torch.zeros(3, 4)
    backend(torch.zeros(TORCH_NATIVE_ABOVE_ROWS, 4), weight)
    backend(torch.zeros(TORCH_NATIVE_ABOVE_ROWS + 1, 4), weight)
    assert calls == ["kernel", "torch"]


def test_float64_and_explicit_torch_use_torch():
    assert select_linear_backend("auto", torch.float64, "cpu").name == "torch"
    assert select_linear_backend("torch", torch.float32, "cpu").name == "torch"


def test_explicit_kernel_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="cpu-gemm.*float64"):
        select_linear_backend("cpu-gemm", torch.float64, "cpu")


def test_unavailable_kernel_is_announced_never_silent(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "unavailable_reason", lambda: "no C++ compiler 'g++' on PATH (set CXX)")
    with pytest.warns(UserWarning, match="cpu-gemm kernel unavailable.*no C\\+\\+ compiler"):
        backend = select_linear_backend("auto", torch.float32, "cpu")
    assert backend.name == "torch" and "unavailable" in backend.note
    with pytest.raises(ValueError, match="'cpu-gemm' is unavailable: no C\\+\\+ compiler"):
        select_linear_backend("cpu-gemm", torch.float32, "cpu")


def test_engine_config_rejects_unknown_backend(tiny_model_dir):
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, cpu-gemm"):
        EngineConfig(model=str(tiny_model_dir), linear_backend="mkl")
