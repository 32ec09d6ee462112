"""The model's kernels: torch ops, or mini-infer's native CPU kernels for the matmuls and decode attention.

`cpu_kernels="auto"` takes the native kernels on the CPU for bfloat16 and float32 models: after loading, every
linear weight is packed for the matmul kernel (a tied LM head gets its own packed copy of the embedding).
If the kernels cannot be built, `auto` says so once and runs torch ops; `on` raises instead; `off` always runs
torch ops.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import CPU_KERNEL_MODES
from mini_infer.kernels import cpu
from mini_infer.model.attention import AttentionMetadata, paged_attention


@dataclass(frozen=True, slots=True)
class Ops:
    native: bool  # the native CPU kernels run
    note: str  # why, for logs and benchmark reports

    def linear(self, x: torch.Tensor, weight: torch.Tensor | cpu.PackedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, cpu.PackedWeight):
            return cpu.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, cpu.paged_decode_attention if self.native else None)

    def prepare(self, linear_weights: list[tuple[nn.Module, str]]) -> None:
        """Swap each named linear weight for its packed form when the native kernels run."""
        if not self.native:
            return
        for module, name in linear_weights:
            weight = getattr(module, name)
            module._parameters.pop(name, None)  # a tied head keeps the embedding registered under its own name
            setattr(module, name, cpu.pack_weight(weight.data))


def select_ops(mode: str, dtype: torch.dtype, device: str | torch.device) -> Ops:
    assert mode in CPU_KERNEL_MODES, mode  # EngineConfig validated it
    if mode == "off":
        return Ops(False, "torch ops (cpu_kernels off)")
    if torch.device(device).type != "cpu" or dtype not in cpu.DTYPES:
        if mode == "on":
            raise ValueError(f"cpu_kernels 'on' runs bfloat16/float32 models on the CPU, not {dtype} on {device}")
        return Ops(False, f"torch ops (the native kernels cover bfloat16/float32 on the CPU, not {dtype} "
                          f"on {device})")
    reason = cpu.unavailable_reason()
    if reason is not None:
        if mode == "on":
            raise ValueError(f"cpu_kernels 'on' but the native kernels are unavailable: {reason}")
        warnings.warn(f"native CPU kernels unavailable ({reason}); the model runs torch ops", stacklevel=2)
        return Ops(False, f"torch ops (native CPU kernels unavailable: {reason})")
    return Ops(True, "native CPU kernels (AVX2 matmul with packed weights, paged decode attention)")
