"""The model's kernels on a GPU: torch's matmuls (cuBLAS) and mini-infer's Triton kernels (kernels/triton) for paged
attention, the RoPE + KV store (with Qwen3's q/k norms), add + RMSNorm and SiLU-and-mul.

The same interface as model/ops.Ops, so the model code never asks which device it runs on. A decode-only step reads
its inputs from tensors alone (no host copies or syncs), which is what lets a CUDA graph replay it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from mini_infer.kernels.triton import attention as triton_attention
from mini_infer.kernels.triton import fused as triton_fused
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, experts_sum, route_experts, torch_linear

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Where the kernels run in Triton's interpreter (the CPU, in tests): a nominal multiprocessor count, small enough
# that a few requests' decode splits its context (the split-KV path then runs under test too).
INTERPRETER_SMS = 4


def unavailable_reason(dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
    """Why the Triton kernels cannot run this model here, or None."""
    if dtype not in TRITON_DTYPES:
        return f"the Triton kernels cover bfloat16, float16 and float32, not {dtype}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the Triton kernels take a head_dim that is a power of two >= 16, not {head_dim}"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the Triton kernels run on a CUDA device (or in Triton's interpreter, TRITON_INTERPRET=1), not on "
                f"{device}")
    return None


@dataclass(frozen=True, slots=True)
class TritonOps:
    note: str
    num_sms: int  # the device's multiprocessors: how far decode splits each context
    native: bool = False  # the CPU's native kernels (model/ops.py): never here
    graph_safe: bool = True  # a decode step reads tensors alone: a CUDA graph can replay it
    quantization: str | None = None
    dtype: torch.dtype = torch.bfloat16
    chosen: dict[str, list[str]] = field(default_factory=dict)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return torch_linear(x, weight, bias, out)

    def native_linear(self, weight: torch.Tensor, rows: int) -> None:
        return None

    def grouped_linear(self, x: torch.Tensor, weights: list[torch.Tensor], offsets: list[int]) -> None:
        """No grouped matmul on the GPU: a mixture's experts run one by one (model/moe.py)."""
        return None

    def decode_splits(self, num_seqs: int, num_kv_heads: int) -> int:
        return triton_attention.decode_splits(num_seqs, num_kv_heads, self.num_sms)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The leading decodes in one decode launch (split by the batch's size), the prompt chunks after them in one
        prefill launch."""
        decodes, num_reqs = meta.num_decodes, meta.num_reqs
        out = torch.empty_like(q)
        if decodes:
            triton_attention.paged_decode(q[:decodes], k_cache, v_cache, meta.block_tables[:decodes],
                                          meta.context_lens[:decodes], self.decode_splits(decodes, k_cache.shape[2]),
                                          out=out[:decodes])
        if decodes < num_reqs:
            triton_attention.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start,
                                           decodes, num_reqs - decodes, meta.max_query_len, out)
        return out

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused.add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_fused.silu_mul(gate_up)

    def route_experts(self, scores: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, list[int]]:
        return route_experts(scores, top_k, norm)

    def experts_sum(self, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
                    num_tokens: int) -> torch.Tensor:
        return experts_sum(y, weights, order, top_k, num_tokens)

    def runs(self, kernel: str) -> bool:
        """The CPU's optional native kernels (model/ops.py): none here."""
        return False

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    top_k = None  # the sampler's torch paths run on the device
    mask_rows = None

    def rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, num_heads: int,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        return triton_fused.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, *kv_cache, slot_mapping, num_heads,
                                          None if q_norm is None else q_norm.weight,
                                          None if k_norm is None else k_norm.weight,
                                          q_norm.eps if q_norm is not None else 0.0)

    def prepare(self, linear_weights: list[tuple[nn.Module, str]]) -> None:
        """The weights stay as loaded: torch's matmul reads them."""

    def matmul_choices(self) -> None:
        return None


def triton_ops(dtype: torch.dtype, device: torch.device) -> TritonOps:
    """The GPU backend for a model of `dtype` on `device` (check unavailable_reason first)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        where = f"on {torch.cuda.get_device_name(device)} ({sms} SMs)"
    else:
        sms, where = INTERPRETER_SMS, "in Triton's interpreter on the CPU"
    return TritonOps(f"Triton kernels {where}: paged decode (split-KV) and prefill attention, RoPE + KV store, "
                     "add + RMSNorm, SiLU-and-mul; torch's matmuls", sms, dtype=dtype)
