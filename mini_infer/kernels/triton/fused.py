"""The decoder's small ops fused in Triton, one program per token row: RoPE with the KV store (and Qwen3's per-head
q/k RMSNorm before it), the residual add with RMSNorm, SiLU-and-multiply.

They round where the torch ops they replace round (the residual sum, the normalised row before its weight, SiLU
before the product), so a bf16 model gives what the per-op torch path gives up to the order of a row's sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(x_ptr, count, cos, sin, norm_weight, eps,
                HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """`count` heads at x_ptr (each HEAD_DIM wide, one after another) -> their two rotated halves in float32, RMS-
    normalised first with QK_NORM."""
    half = tl.arange(0, HEAD_DIM // 2)
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < count)[:, None]
    at = x_ptr + heads[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        dtype = x_ptr.dtype.element_ty
        scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_weight + half).to(tl.float32)[None, :]
        w2 = tl.load(norm_weight + HEAD_DIM // 2 + half).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_kv_kernel(qkv, positions, cos_table, sin_table, q_out, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
                    qkv_stride, q_out_stride, table_stride, cache_stride_slot, cache_stride_head, num_heads,
                    num_kv_heads, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    QK_NORM: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions + token).to(tl.int64)
    half = tl.arange(0, HEAD_DIM // 2)
    cos = tl.load(cos_table + position * table_stride + half).to(tl.float32)[None, :]
    sin = tl.load(sin_table + position * table_stride + half).to(tl.float32)[None, :]
    row = qkv + token.to(tl.int64) * qkv_stride
    q1, q2 = _rope_heads(row, num_heads, cos, sin, q_norm, eps, HEADS_PAD, HEAD_DIM, QK_NORM)
    heads = tl.arange(0, HEADS_PAD)
    q_at = q_out + token.to(tl.int64) * q_out_stride + heads[:, None] * HEAD_DIM + half[None, :]
    q_mask = (heads < num_heads)[:, None]
    tl.store(q_at, q1.to(q_out.dtype.element_ty), mask=q_mask)
    tl.store(q_at + HEAD_DIM // 2, q2.to(q_out.dtype.element_ty), mask=q_mask)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    k1, k2 = _rope_heads(row + num_heads * HEAD_DIM, num_kv_heads, cos, sin, k_norm, eps, KV_PAD, HEAD_DIM, QK_NORM)
    kv_heads = tl.arange(0, KV_PAD)
    stored = tl.where(slot >= 0, num_kv_heads, 0)  # a padded row (slot -1) stores nothing
    kv_mask = (kv_heads < stored)[:, None]
    cache_at = slot * cache_stride_slot + kv_heads[:, None] * cache_stride_head + half[None, :]
    tl.store(k_cache + cache_at, k1.to(k_cache.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache + cache_at + HEAD_DIM // 2, k2.to(k_cache.dtype.element_ty), mask=kv_mask)
    v_at = row + (num_heads + num_kv_heads) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + half[None, :]
    tl.store(v_cache + cache_at, tl.load(v_at, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(v_cache + cache_at + HEAD_DIM // 2, tl.load(v_at + HEAD_DIM // 2, mask=kv_mask, other=0.0), mask=kv_mask)


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) head_dim] -> q [T, heads, head_dim] rotated; k rotated and v stored in the caches
    ([blocks, block_size, kv_heads, head_dim]) at slot_mapping [T] (-1: not stored). With q_norm / k_norm
    ([head_dim]), each head of q / k is RMS-normalised (eps) before the rotation (Qwen3). cos / sin: [positions,
    head_dim] tables (each half repeated)."""
    num_tokens = qkv.shape[0]
    _, _, kv_heads, head_dim = k_cache.shape
    if (qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim
            or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride() or k_cache.dtype != qkv.dtype
            or v_cache.dtype != qkv.dtype or cos.stride() != sin.stride() or cos.stride(1) != 1
            or head_dim & (head_dim - 1) or (q_norm is None) != (k_norm is None)):
        raise ValueError(f"rope_kv_write: qkv {tuple(qkv.shape)} {qkv.dtype} must be [tokens, (heads + 2 kv_heads) "
                         f"head_dim] with {num_heads} heads over caches {tuple(k_cache.shape)} {k_cache.dtype} of its "
                         "dtype, head_dim a power of two, q_norm and k_norm both given or neither")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rope_kv_kernel[(num_tokens,)](
            qkv, positions, cos, sin, q, k_cache, v_cache, slot_mapping, q_norm if q_norm is not None else qkv,
            k_norm if k_norm is not None else qkv, eps, qkv.stride(0), q.stride(0), cos.stride(0), k_cache.stride(1),
            k_cache.stride(2), num_heads, kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, QK_NORM=q_norm is not None)
    return q


@triton.jit
def _add_rms_norm_kernel(x, residual, weight, out, residual_out, eps, x_stride, residual_stride, out_stride,
                         residual_out_stride, hidden, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out.dtype.element_ty
    total = tl.load(x + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        total = (total + tl.load(residual + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32))
        total = total.to(dtype)
        tl.store(residual_out + row * residual_out_stride + cols, total, mask=mask)
        total = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(total * total, 0) / hidden + eps)
    normed = (total * scale).to(dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * out_stride + cols, (w * normed).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for rows [T, hidden], or (RMSNorm(x) * weight, x) without a
    residual."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != x.shape[1:] or (
            residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, weight {tuple(weight.shape)} must be "
                         "rows [T, hidden] (each contiguous), the same for the residual, and [hidden]")
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, summed, eps, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), summed.stride(0), x.shape[1],
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, summed


@triton.jit
def _silu_mul_kernel(gate_up, out, gate_up_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out.dtype.element_ty
    gate = tl.load(gate_up + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * gate_up_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must be rows [T, 2I], each contiguous")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                                 BLOCK=SILU_BLOCK)
    return out
