"""The model's kernels: torch ops, or mini-infer's native CPU kernels for the matmuls and decode attention.

`cpu_kernels="auto"` takes the native kernels on the CPU for bfloat16 and float32 models, and for each linear
weight shape and batch-size bucket the fastest of the native matmul paths this CPU runs (AVX2, AVX-512F,
AVX512_BF16, AMX) and torch's (kernels/autotune.py): a weight is kept in the forms its winners read (packed
panels, bf16 pairs, as it is for torch; a tied LM head's packed copies are its own). `on` runs the best native
path everywhere (AMX for bf16, then AVX512_BF16, then AVX-512F, then AVX2). If the kernels cannot be built,
`auto` says so once and runs torch ops; `on` raises instead; `off` always runs torch ops.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import CPU_KERNEL_MODES
from mini_infer.kernels import cpu, fused
from mini_infer.kernels.autotune import LinearTuner, bucket_index, last_level_cache_bytes, machine_key, timed_ms
from mini_infer.model.attention import AttentionMetadata, paged_attention, write_kv
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from mini_infer.profiling import profiled


@dataclass(frozen=True, slots=True)
class TunedWeight:
    """A linear weight in the forms its timed choices need: packed per native layout, as it is for torch."""

    packed: dict[str, cpu.PackedWeight]  # layout ("panels", "pairs") -> packed weight
    dense: torch.Tensor | None
    winners: tuple[str, ...]  # per autotune bucket: a native path (cpu.MATMUL_PATHS) or "torch"

    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.packed.values()] + ([self.dense] if self.dense is not None else [])

    @property
    def dtype(self) -> torch.dtype:
        return self.dense.dtype if self.dense is not None else next(iter(self.packed.values())).dtype


@dataclass(frozen=True, slots=True)
class Ops:
    native: bool  # the native CPU kernels run
    note: str  # why, for logs and benchmark reports
    tuner: LinearTuner | None = None  # with the native kernels: None runs `path` everywhere
    path: str = "avx2"  # the native matmul path without a tuner

    def linear(self, x: torch.Tensor, weight: torch.Tensor | cpu.PackedWeight | TunedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        native = self.native_linear(weight, x.shape[0])
        if native is not None:
            return cpu.linear(x, native[1], bias, native[0])
        return F.linear(x, weight.dense if isinstance(weight, TunedWeight) else weight, bias)

    def native_linear(self, weight: torch.Tensor | cpu.PackedWeight | TunedWeight,
                      rows: int) -> tuple[str, cpu.PackedWeight] | None:
        """The native path and packed weight that a matmul of `rows` rows by `weight` runs on, or None where
        torch's does."""
        if isinstance(weight, TunedWeight):
            path = weight.winners[bucket_index(rows)]
            return None if path == "torch" else (path, weight.packed[cpu.weight_layout(path, weight.dtype)])
        return (self.path, weight) if isinstance(weight, cpu.PackedWeight) else None

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        if not self.native:
            return paged_attention(q, k_cache, v_cache, meta)
        return paged_attention(q, k_cache, v_cache, meta, cpu.paged_decode_attention, cpu.paged_prefill_attention)

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

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1) of logits [R, V] (greedy decoding); natively in one threaded pass for bf16/float32."""
        return fused.argmax(x) if self.native and x.dtype in cpu.DTYPES else x.argmax(dim=-1)

    @property
    def top_k(self):
        """The sampler's top-k over the logits (fused.top_k: each row's k largest after its sparse edits, in one pass)
        where the native kernels run, whose logits are then bfloat16 or float32; None elsewhere (the sampler then
        works on a copy of the logits with torch)."""
        return fused.top_k if self.native else None

    def rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) D] -> q [T, heads, D] rotated; k rotated and v stored at their cache slots
        (with the native kernels in one pass, which the profile's kv_write range then covers)."""
        k_cache, v_cache = kv_cache
        if self.native:
            with profiled("kv_write"):
                return fused.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping,
                                           num_heads)
        num_tokens, (kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
        q, k, v = qkv.split((num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        q, k = rotary(positions, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, kv_heads, head_dim))
        with profiled("kv_write"):
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
                setattr(module, name, cpu.pack_weight(weight, cpu.weight_layout(self.path, weight.dtype)))
                continue
            winners = self.tuner.winners(*weight.shape)
            layouts = {cpu.weight_layout(w, weight.dtype) for w in winners if w != "torch"}
            setattr(module, name, TunedWeight({layout: cpu.pack_weight(weight, layout) for layout in sorted(layouts)},
                                              weight if "torch" in winners else None, winners))
        timer = getattr(self.tuner, "timer", None)
        if isinstance(timer, _LinearTimer):
            timer.release()

    def matmul_choices(self) -> dict[str, list[str]] | None:
        """What the autotuner chose per weight shape and bucket (None without one), for reports."""
        return self.tuner.choices() if self.tuner is not None else None


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
    paths = cpu.matmul_paths(dtype)
    runnable = tuple(path for path, why in paths.items() if why is None)
    missing = "; ".join(f"{path}: {why}" for path, why in paths.items() if why is not None)
    lacking = f" (not here: {missing})" if missing else ""
    if mode == "on":
        return Ops(True, f"native CPU kernels ({runnable[-1]} matmul with packed weights, paged decode "
                         f"attention){lacking}", path=runnable[-1])
    tuner = LinearTuner(machine_key(dtype, cpu.gemm_source()), _LinearTimer(dtype), (*runnable, "torch"))
    return Ops(True, f"native CPU kernels (paged decode attention; per weight shape and batch size, the fastest of "
                     f"{', '.join(runnable)} and torch's matmul, timed once: {tuner.path}){lacking}", tuner)


class _LinearTimer:
    """Times one call of a candidate matmul on random data of a weight's shape (the weights made once per shape,
    the rows once per row count).

    A decode step's matmuls (up to STREAMING_ROWS rows, the decode buckets) stream their weights from memory (a
    model's weights far exceed the caches), so those calls are timed with the weight evicted from every cache level
    first: timed cache-hot, a kernel that streams memory best could lose to one that only computes faster."""

    STREAMING_ROWS = 64

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self._shape, self._weights, self._rows = dtype, None, {}, {}
        self._evict_buffer: torch.Tensor | None = None

    def release(self) -> None:
        """Drop the timing data (the last shape's weights and rows, the eviction buffer) once the model's weights
        are prepared."""
        self._shape, self._weights, self._rows, self._evict_buffer = None, {}, {}, None

    def _evict(self) -> None:
        if self._evict_buffer is None:  # 1.25x the last-level cache, read once per timed call
            self._evict_buffer = torch.ones(last_level_cache_bytes() * 5 // 16, dtype=torch.float32)
        self._evict_buffer.sum()

    def __call__(self, candidate: str, rows: int, out_features: int, in_features: int) -> float:
        if self._shape != (out_features, in_features):
            self._shape, self._rows = (out_features, in_features), {}
            self._weights = {"torch": torch.randn(out_features, in_features).to(self.dtype)}
        dense = self._weights["torch"]
        if rows not in self._rows:
            self._rows[rows] = torch.randn(rows, in_features).to(self.dtype)
        x = self._rows[rows]
        before = self._evict if rows <= self.STREAMING_ROWS else None
        if candidate == "torch":
            return timed_ms(lambda: F.linear(x, dense), before)
        layout = cpu.weight_layout(candidate, self.dtype)
        if layout not in self._weights:
            self._weights[layout] = cpu.pack_weight(dense, layout)
        packed = self._weights[layout]
        return timed_ms(lambda: cpu.linear(x, packed, None, candidate), before)
