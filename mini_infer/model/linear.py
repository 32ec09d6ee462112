"""Which matmul the model's projections and LM head run: torch's F.linear, or the cpu_gemm kernel.

`auto` takes cpu_gemm on the CPU for bfloat16 and float32 weights. Above `max_kernel_rows` rows (prefill)
torch takes over where its matmul is native for the dtype (always for float32 via MKL; for bfloat16 only
with AVX512-BF16/AMX). If the kernel cannot be built, `auto` says so once and uses torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_infer.config import LINEAR_BACKENDS
from mini_infer.kernels import cpu_gemm

# Row count above which a native torch matmul beats the kernel (measured: scripts in docs/BENCHMARKS.md).
TORCH_NATIVE_ABOVE_ROWS = 64


@dataclass(frozen=True, slots=True)
class LinearBackend:
    name: str  # "torch" or "cpu-gemm"
    max_kernel_rows: int | None  # cpu-gemm only: above this many rows F.linear runs instead; None = never
    note: str  # why this backend, for logs and benchmark reports

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.name == "torch" or (self.max_kernel_rows is not None and x.shape[0] > self.max_kernel_rows):
            return F.linear(x, weight, bias)
        return cpu_gemm.linear(x, weight, bias)


def select_linear_backend(requested: str, dtype: torch.dtype, device: str | torch.device) -> LinearBackend:
    assert requested in LINEAR_BACKENDS, requested  # EngineConfig validated it
    if requested == "torch":
        return LinearBackend("torch", None, "requested")
    fits = torch.device(device).type == "cpu" and dtype in cpu_gemm.WEIGHT_DTYPES
    if not fits:
        if requested == "cpu-gemm":
            raise ValueError(f"linear_backend 'cpu-gemm' runs bfloat16/float32 weights on the CPU, not {dtype} "
                             f"on {device}")
        return LinearBackend("torch", None, f"cpu-gemm does not cover {dtype} on {device}")
    reason = cpu_gemm.unavailable_reason()
    if reason is not None:
        if requested == "cpu-gemm":
            raise ValueError(f"linear_backend 'cpu-gemm' is unavailable: {reason}")
        warnings.warn(f"cpu-gemm kernel unavailable ({reason}); the model uses torch's F.linear", stacklevel=2)
        return LinearBackend("torch", None, f"cpu-gemm unavailable: {reason}")
    if requested == "auto" and _torch_matmul_native(dtype):
        return LinearBackend("cpu-gemm", TORCH_NATIVE_ABOVE_ROWS,
                             f"cpu-gemm up to {TORCH_NATIVE_ABOVE_ROWS} rows, torch's native {dtype} matmul above")
    return LinearBackend("cpu-gemm", None, "cpu-gemm for every matmul" + (
        "" if requested == "cpu-gemm" else f" (torch has no native {dtype} matmul on this CPU)"))


def _torch_matmul_native(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
