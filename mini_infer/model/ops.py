"""The model's kernels: torch ops, or mini-infer's native CPU kernels for the matmuls and decode attention.

`cpu_kernels="auto"` takes the native kernels on the CPU for bfloat16 and float32 models, and for each linear
weight shape and batch-size bucket the faster of the native matmul and torch's (kernels/autotune.py): a weight is
packed for the native kernel where it wins, kept as it is where torch does (both, when each wins somewhere; a tied
LM head's packed copy is its own). `on` runs the native matmul everywhere. If the kernels cannot be built, `auto`
says so once and runs torch ops; `on` raises instead; `off` always runs torch ops.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from mini_infer.config import CPU_KERNEL_MODES
from mini_infer.kernels import cpu, fused
from mini_infer.kernels.autotune import LinearTuner, bucket_index, machine_key, median_ms
from mini_infer.model.attention import AttentionMetadata, paged_attention, write_kv
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul


@dataclass(frozen=True, slots=True)
class TunedWeight:
    """A linear weight in the forms its timed choices need: packed for the native kernel, as it is for torch."""

    packed: cpu.PackedWeight | None
    dense: torch.Tensor | None
    winners: tuple[str, ...]  # per autotune bucket: "native" or "torch"

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed.data if self.packed else None, self.dense) if t is not None]


@dataclass(frozen=True, slots=True)
class Ops:
    native: bool  # the native CPU kernels run
    note: str  # why, for logs and benchmark reports
    tuner: LinearTuner | None = None  # with the native kernels: None runs the native matmul everywhere

    def linear(self, x: torch.Tensor, weight: torch.Tensor | cpu.PackedWeight | TunedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, TunedWeight):
            if weight.winners[bucket_index(x.shape[0])] == "native":
                return cpu.linear(x, weight.packed, bias)
            return F.linear(x, weight.dense, bias)
        if isinstance(weight, cpu.PackedWeight):
            return cpu.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, cpu.paged_decode_attention if self.native else None)

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual: the residual stream's add
        done by the norm after it, in one pass with the native kernels."""
        if not self.native:
            x = x if residual is None else x + residual
            return norm(x), x
        if residual is None:
            return fused.rms_norm(x, norm.weight, norm.eps), x
        return fused.add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up) if self.native else silu_and_mul(gate_up)

    def rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) D] -> q [T, heads, D] rotated; k rotated and v stored at their cache slots
        (with the native kernels in one pass, which the profile's kv_write range then covers)."""
        k_cache, v_cache = kv_cache
        if self.native:
            with record_function("kv_write"):
                return fused.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping,
                                           num_heads)
        num_tokens, (kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
        q, k, v = qkv.split((num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        q, k = rotary(positions, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, kv_heads, head_dim))
        with record_function("kv_write"):
            write_kv(k_cache, v_cache, k, v.view(num_tokens, kv_heads, head_dim), slot_mapping)
        return q

    def prepare(self, linear_weights: list[tuple[nn.Module, str]]) -> None:
        """Swap each named linear weight for the forms its matmuls run on when the native kernels run."""
        if not self.native:
            return
        for module, name in linear_weights:
            weight = getattr(module, name).data
            module._parameters.pop(name, None)  # a tied head keeps the embedding registered under its own name
            if self.tuner is None:
                setattr(module, name, cpu.pack_weight(weight))
                continue
            winners = self.tuner.winners(*weight.shape)
            setattr(module, name, TunedWeight(cpu.pack_weight(weight) if "native" in winners else None,
                                              weight if "torch" in winners else None, winners))


def select_ops(mode: str, dtype: torch.dtype, device: str | torch.device) -> Ops:
    assert mode in CPU_KERNEL_MODES, mode  # EngineConfig validated it
    if mode == "off":
        return Ops(False, "torch ops (cpu_kernels off)")
    if torch.device(device).type != "cpu" or dtype not in cpu.DTYPES:
        if mode == "on":
            raise ValueError(f"cpu_kernels 'on' runs bfloat16/float32 models on the CPU, not {dtype} on {device}")
        return Ops(False, f"torch ops (the native kernels cover bfloat16/float32 on the CPU, not {dtype} "
                          f"on {device})")
    reason = fused.unavailable_reason()  # the fused kernels' and every other native kernel's
    if reason is not None:
        if mode == "on":
            raise ValueError(f"cpu_kernels 'on' but the native kernels are unavailable: {reason}")
        warnings.warn(f"native CPU kernels unavailable ({reason}); the model runs torch ops", stacklevel=2)
        return Ops(False, f"torch ops (native CPU kernels unavailable: {reason})")
    if mode == "on":
        return Ops(True, "native CPU kernels (AVX2 matmul with packed weights, paged decode attention)")
    tuner = LinearTuner(machine_key(dtype, cpu.gemm_source()), _LinearTimer(dtype))
    return Ops(True, "native CPU kernels (paged decode attention; per weight shape and batch size, the faster of the "
                     f"AVX2 matmul and torch's, timed once: {tuner.path})", tuner)


class _LinearTimer:
    """Times one candidate matmul on random data of a weight's shape (the weights made once per shape)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self._shape, self._weights = dtype, None, None

    def __call__(self, candidate: str, rows: int, out_features: int, in_features: int) -> float:
        if self._shape != (out_features, in_features):
            dense = torch.randn(out_features, in_features).to(self.dtype)
            self._shape, self._weights = (out_features, in_features), (dense, cpu.pack_weight(dense))
        dense, packed = self._weights
        x = torch.randn(rows, in_features).to(self.dtype)
        if candidate == "native":
            return median_ms(lambda: cpu.linear(x, packed))
        return median_ms(lambda: F.linear(x, dense))
