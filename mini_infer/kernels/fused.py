"""The native fused elementwise kernels of a decoder layer (cpu_fused.cpp): residual add + RMSNorm, SiLU x up,
RoPE with the K/V cache write, a mixture's weighted sum of its experts' outputs. Each rounds exactly where torch's ops
on the same dtype round.

Built and loaded with the other native kernels (kernels/cpu.py, whose availability check covers them).
"""

from __future__ import annotations

import functools
import warnings

import torch

from mini_infer.kernels import cpu

@functools.cache
def sum_width() -> int:
    """The lanes (8 or 16) of torch's float32 sum kernel here, found by normalising a probe both ways: the norm's
    mean of squares must add in torch's order to round as RMSNorm.forward does, and which of its AVX2 or AVX-512
    builds torch dispatches to is torch's business."""
    probe = torch.randn(4, 4096, generator=torch.Generator().manual_seed(0))
    expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + 1e-6)
    for width in (8, 16):
        out, _ = _launch_norm(probe, None, torch.ones(4096), 1e-6, width)
        if torch.equal(out, expected):
            return width
    warnings.warn("the fused RMSNorm cannot reproduce torch's float32 sum order here: its results may differ from "
                  "torch's in the last bit", stacklevel=2)
    return 8


def _check_rows(name: str, weight: torch.Tensor, *tensors: torch.Tensor) -> None:
    x = tensors[0]
    if (x.dim() != 2 or x.dtype not in cpu.DTYPES or weight.shape != (x.shape[1],) or weight.dtype != x.dtype
            or any(t.dtype != x.dtype or t.shape != x.shape for t in tensors)):
        raise ValueError(f"{name}: tensors {[(tuple(t.shape), t.dtype) for t in tensors]} with a weight "
                         f"{tuple(weight.shape)} {weight.dtype}: all [T, H] and of one dtype (bfloat16/float32)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward of x [T, H]."""
    _check_rows("rms_norm", weight, x)
    return _add_rms_norm(x.contiguous(), None, weight.contiguous(), eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm.forward(x + residual), x + residual), in one pass over x [T, H] and residual [T, H]."""
    _check_rows("add_rms_norm", weight, x, residual)
    return _add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)


def _add_rms_norm(x, residual, weight, eps):
    return _launch_norm(x, residual, weight, eps, sum_width())


def _launch_norm(x, residual, weight, eps, width):
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    cpu.native_function("add_rms_norm")(
        x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
        residual_out.data_ptr(), cpu.DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], eps, width, torch.get_num_threads())
    return out, residual_out


def rms_norm_heads(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                   num_kv_heads: int, eps: float) -> None:
    """Qwen3's q_norm over each query head and k_norm over each key head of qkv [T, (heads + 2 kv_heads) D], in
    place: as rms_norm on those heads as rows."""
    head_dim = q_weight.shape[0]
    if (qkv.dim() != 2 or qkv.dtype not in cpu.DTYPES or not qkv.is_contiguous()
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
            or any(w.shape != (head_dim,) or w.dtype != qkv.dtype for w in (q_weight, k_weight))):
        raise ValueError(f"rms_norm_heads: qkv {tuple(qkv.shape)} {qkv.dtype} (contiguous: {qkv.is_contiguous()}) with "
                         f"{num_heads} + 2 x {num_kv_heads} heads, weights {tuple(q_weight.shape)} "
                         f"{tuple(k_weight.shape)}")
    cpu.native_function("rms_norm_heads")(qkv.data_ptr(), q_weight.contiguous().data_ptr(),
                                          k_weight.contiguous().data_ptr(), cpu.DTYPE_CODES[qkv.dtype], qkv.shape[0],
                                          num_heads, num_kv_heads, head_dim, eps, sum_width(), torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> F.silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in cpu.DTYPES:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} {gate_up.dtype} must be [T, 2I] bfloat16/float32")
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    cpu.native_function("silu_mul")(gate_up.data_ptr(), out.data_ptr(), cpu.DTYPE_CODES[gate_up.dtype], *out.shape,
                                    torch.get_num_threads())
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
                num_tokens: int) -> torch.Tensor:
    """layers.experts_sum in one pass: y [P, H] (row p: entry order[p] of the [num_tokens, top_k] routing) weighted
    by weights [num_tokens * top_k] and summed per token into [num_tokens, H], rounded as torch's ops round."""
    if (y.dim() != 2 or y.dtype not in cpu.DTYPES or weights.dtype != y.dtype
            or weights.shape != (num_tokens * top_k,) or order.shape != (y.shape[0],)):
        raise ValueError(f"moe_combine: y {tuple(y.shape)} {y.dtype}, weights {tuple(weights.shape)} {weights.dtype}, "
                         f"order {tuple(order.shape)} for {num_tokens} tokens of {top_k} experts")
    y, weights, order = y.contiguous(), weights.contiguous(), order.to(torch.int64).contiguous()
    out = torch.empty(num_tokens, y.shape[1], dtype=y.dtype)
    if cpu.native_function("moe_combine")(y.data_ptr(), weights.data_ptr(), order.data_ptr(), out.data_ptr(),
                                          cpu.DTYPE_CODES[y.dtype], y.shape[0], num_tokens, y.shape[1], top_k,
                                          torch.get_num_threads()):
        raise ValueError(f"moe_combine: order entries in [{int(order.min())}, {int(order.max())}] (must be in "
                         f"[0, {num_tokens * top_k - 1}])")
    return out


def moe_route(scores: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      list[int]]:
    """layers.route_experts in one pass over the router's scores [T, E] (bfloat16/float32): (weights [T top_k],
    order [T top_k], rows [T top_k], each expert's pair count)."""
    if scores.dim() != 2 or scores.dtype not in cpu.DTYPES or not 0 < top_k <= scores.shape[1]:
        raise ValueError(f"moe_route: scores {tuple(scores.shape)} {scores.dtype}, top_k {top_k}")
    scores = scores.contiguous()
    tokens, experts = scores.shape
    weights = torch.empty(tokens * top_k, dtype=scores.dtype)
    order, rows = (torch.empty(tokens * top_k, dtype=torch.int64) for _ in range(2))
    counts = torch.empty(experts, dtype=torch.int64)
    if cpu.native_function("moe_route")(scores.data_ptr(), cpu.DTYPE_CODES[scores.dtype], tokens, experts, top_k,
                                        int(norm), weights.data_ptr(), order.data_ptr(), rows.data_ptr(),
                                        counts.data_ptr(), torch.get_num_threads()):
        raise ValueError("moe_route: the router's scores hold NaN")
    return weights, order, rows, counts.tolist()


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) D] -> q [T, heads, D] rotated at `positions` (RotaryEmbedding's rotate-half
    form with its cos/sin tables [max_positions, D]); k rotated and v are stored at their `slot_mapping` slots of
    k_cache / v_cache [num_blocks, block_size, kv_heads, D]."""
    num_tokens = qkv.shape[0]
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    # The kernel indexes raw memory: anything out of shape or range would write outside the caches.
    if (qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim or head_dim % 2
            or qkv.dtype not in cpu.DTYPES or any(t.dtype != qkv.dtype for t in (cos, sin, k_cache, v_cache))
            or cos.shape != sin.shape or cos.shape[1:] != (head_dim,) or not cpu.caches_fit(k_cache, v_cache)
            or not (cos.is_contiguous() and sin.is_contiguous())
            or positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,)):
        raise ValueError(f"rope_kv_write: qkv {tuple(qkv.shape)} {qkv.dtype} for {num_heads} heads, "
                         f"{cpu.describe_caches(k_cache, v_cache)}, cos/sin {tuple(cos.shape)} {cos.dtype}, "
                         f"positions {tuple(positions.shape)}, slot mapping {tuple(slot_mapping.shape)}")
    qkv = qkv.contiguous()
    positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    # The kernel checks the slots and positions before it writes anything (1: out of range).
    if cpu.native_function("rope_kv_write")(
            qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slot_mapping.data_ptr(), cpu.DTYPE_CODES[qkv.dtype], num_tokens, num_heads, kv_heads,
            head_dim, num_blocks * block_size, cos.shape[0], torch.get_num_threads()):
        raise rope_range_error(slot_mapping, positions, num_blocks * block_size, cos.shape[0])
    return q


def rope_range_error(slot_mapping: torch.Tensor, positions: torch.Tensor, num_slots: int,
                     max_positions: int) -> ValueError:
    """What the RoPE/KV-write kernel refused (it returned 1): the ranges it found and the ones it allows."""
    return ValueError(f"rope_kv_write: slots in {cpu.span(slot_mapping)} (must be in [0, {num_slots - 1}]), positions "
                      f"in {cpu.span(positions)} (must be in [0, {max_positions - 1}])")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of x [R, C] (rows may be a slice of wider ones): the first index of each row's maximum, or of
    its first NaN, as int64 [R]."""
    if x.dim() != 2 or x.dtype not in cpu.DTYPES or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)} {x.dtype} (strides {x.stride()}) must be [R, C] with C > 0, "
                         "bfloat16/float32, each row contiguous")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cpu.native_function("argmax_rows")(x.data_ptr(), cpu.DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.stride(0),
                                       out.data_ptr(), torch.get_num_threads())
    return out


def top_k(x: torch.Tensor, ks: torch.Tensor, edit_ids: torch.Tensor,
          edit_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row r of x [R, C] (rows may be slices of wider ones) with its entries at edit_ids[r] replaced by
    edit_values[r] ([R, W] int64 / float32; an id >= C is padding, of an id listed twice the lower value counts),
    and its ks[r] largest entries of that, found in one pass over the row without a copy of it: (values float32,
    ids int64), each [R, max(ks)], best first (a NaN above every number; of equal values the lower index, as
    argmax). A row keeping fewer than max(ks) is padded with -inf and its best id."""
    rows, width = x.shape if x.dim() == 2 else (0, 0)
    if (x.dim() != 2 or x.dtype not in cpu.DTYPES or x.stride(1) != 1 or width == 0 or ks.shape != (rows,)
            or edit_ids.dim() != 2 or edit_ids.shape[0] != rows or edit_values.shape != edit_ids.shape):
        raise ValueError(f"top_k: x {tuple(x.shape)} {x.dtype} (strides {x.stride()}) must be [R, C] with C > 0, "
                         f"bfloat16/float32, each row contiguous; ks {tuple(ks.shape)} must be [R]; edits "
                         f"{tuple(edit_ids.shape)} / {tuple(edit_values.shape)} must be [R, W] both")
    ks = ks.to(torch.int64).contiguous()
    edit_ids = edit_ids.to(torch.int64).contiguous()
    edit_values = edit_values.to(torch.float32).contiguous()
    k_max = int(ks.max()) if rows else 1
    values = torch.empty(rows, k_max, dtype=torch.float32)
    ids = torch.empty(rows, k_max, dtype=torch.int64)
    # The kernel checks the ks and edit ids before it writes anything (1: out of range).
    if cpu.native_function("top_k_rows")(x.data_ptr(), cpu.DTYPE_CODES[x.dtype], rows, width, x.stride(0),
                                         ks.data_ptr(), k_max, edit_ids.data_ptr(), edit_values.data_ptr(),
                                         edit_ids.shape[1], values.data_ptr(), ids.data_ptr(), torch.get_num_threads()):
        lowest = int(edit_ids.min()) if edit_ids.numel() else 0
        raise ValueError(f"top_k: ks in [{int(ks.min())}, {k_max}] must be in [1, {width}], edit ids from {lowest} "
                         "must be >= 0")
    return values, ids


def mask_rows(x: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs' token bitmask, in place: in each row rows[i] of x [R, C] (float32, rows may be slices of
    wider ones), the tokens whose bit is clear in bitmask[rows[i]] (int32 [R, >= ceil(C / 32)]; bit j of word w is
    token 32 w + j) become -inf."""
    rows_, width = x.shape if x.dim() == 2 else (0, 0)
    if (x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or bitmask.dtype != torch.int32
            or bitmask.dim() != 2 or bitmask.shape[0] != rows_ or bitmask.shape[1] * 32 < width
            or not all(0 <= r < rows_ for r in rows)):
        raise ValueError(f"mask_rows: x {tuple(x.shape)} {x.dtype} (strides {x.stride()}) must be float32 [R, C] "
                         f"with contiguous rows, bitmask {tuple(bitmask.shape)} {bitmask.dtype} int32 [R, >= C / 32], "
                         f"rows in [0, R)")
    bitmask = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    cpu.native_function("mask_rows")(x.data_ptr(), x.stride(0), width, index.data_ptr(), len(rows),
                                     bitmask.data_ptr(), bitmask.shape[1], torch.get_num_threads())
    return x
