"""Paged attention in Triton, reading K/V in place through the block tables (no gather of the context).

The caches are [num_blocks, block_size, kv_heads, head_dim]; a request's token i lives in block
block_table[i // block_size] at offset i % block_size. Scores and the online softmax run in float32 (log2 domain).

- decode: one query token per request. A program takes one request's KV head and all the query heads that share it
  (GQA), so each K/V row is read once per step; with few requests the context is split over several programs
  (split-KV) whose partial results a second kernel combines.
- prefill: packed variable-length queries (prompt chunks) at the end of each request's context, which may hold a
  cached prefix or earlier chunks: query i of a request of context c and q new tokens sits at position c - q + i and
  sees keys 0..c - q + i.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # context tokens per decode iteration
PREFILL_BLOCK_M, PREFILL_BLOCK_N = 64, 64  # query rows and context tokens per prefill tile
MAX_SPLITS = 16
# tl.dot's input precision: float32 in IEEE arithmetic (tf32 would keep 10 bits of its mantissa); bf16 and fp16
# inputs ignore it.
_PRECISION = "ieee"


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Parts each request's context is split into for decode: doubled while the grid of num_seqs x kv_heads x parts
    programs stays under two waves of the GPU's multiprocessors, at most MAX_SPLITS (a power of two, as the
    combining kernel needs)."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_kv_heads * splits * 2 <= 2 * num_sms:
        splits *= 2
    return splits


@triton.jit
def _attend_tile(query, k_cache, v_cache, table, tokens, valid, visible, kv_head, dims, m_i, l_i, acc, qk_scale,
                 cache_stride_block, cache_stride_slot, cache_stride_head, BLOCK_SIZE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One tile of context tokens (those `valid`, at least one) into the online softmax of the query rows: each row
    weighs the tokens `visible` to it. Returns the running maximum, sum and weighted values."""
    block = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows_at = block * cache_stride_block + (tokens % BLOCK_SIZE) * cache_stride_slot + kv_head * cache_stride_head
    keys = tl.load(k_cache + rows_at[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    values = tl.load(v_cache + rows_at[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, qk_scale,
                   q_stride_t, q_stride_h, bt_stride, cache_stride_block, cache_stride_slot, cache_stride_head,
                   out_stride_t, out_stride_h, num_heads,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, context_len)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(q + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=row_mask[:, None],
                    other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables + seq.to(tl.int64) * bt_stride
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < hi
        m_i, l_i, acc = _attend_tile(query, k_cache, v_cache, table, tokens, valid, valid[None, :], kv_head, dims,
                                     m_i, l_i, acc, qk_scale, cache_stride_block, cache_stride_slot, cache_stride_head,
                                     BLOCK_SIZE, PRECISION)
    if NUM_SPLITS == 1:
        result = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
                 result.to(out.dtype.element_ty), mask=row_mask[:, None])
    else:
        at = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m + at, m_i, mask=row_mask)
        tl.store(part_l + at, l_i, mask=row_mask)
        tl.store(part_acc + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _combine_kernel(part_m, part_l, part_acc, out, out_stride_t, out_stride_h, num_heads,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    at = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_m + at)
    sums = tl.load(part_l + at)
    m_max = tl.max(m, 0)
    # Empty parts (m = -inf) weigh nothing; a request with no context at all (a padded row) gets zeros.
    weight = tl.where(m > float("-inf"), tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0)), 0.0)
    total = tl.sum(sums * weight, 0)
    acc = tl.load(part_acc + at[:, None] * HEAD_DIM + dims[None, :])
    result = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq * out_stride_t + head * out_stride_h + dims, result.to(out.dtype.element_ty))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.stride(3) != 1 or q.dim() != 3 or q.stride(2) != 1 or q.shape[2] != k_cache.shape[3]
            or q.shape[1] % k_cache.shape[2] or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        raise ValueError(f"paged attention: q {tuple(q.shape)} {q.dtype} must be [tokens, heads, head_dim] over caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} {k_cache.dtype} [blocks, block_size, "
                         "kv_heads, head_dim] of its dtype, heads a multiple of kv_heads, head_dim contiguous")
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"paged attention: head_dim {head_dim} must be a power of two >= 16 for the Triton kernels")
    return k_cache.shape[1], k_cache.shape[2], head_dim


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, num_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, heads, head_dim], one query per request, at the last position of its context (context_lens [R]
    tokens, 0 for a padded row, whose output is zeros) -> [R, heads, head_dim] (into `out` where given). num_splits
    (a power of two up to MAX_SPLITS) parts of each context run in programs of their own, then combine."""
    block_size, kv_heads, head_dim = _check_cache(q, k_cache, v_cache)
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"paged decode: num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    num_seqs, num_heads, _ = q.shape
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"paged decode: out {tuple(out.shape)} must be q's shape {tuple(q.shape)}, head_dim "
                         "contiguous")
    if num_seqs == 0:
        return out
    parts = None
    if num_splits > 1:
        part_m = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=q.device)
        parts = (part_m, torch.empty_like(part_m), torch.empty(part_m.numel(), head_dim, dtype=torch.float32,
                                                                device=q.device))
    scratch = parts or (out, out, out)  # unused without splits
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, *scratch, _LOG2E / math.sqrt(head_dim),
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), num_heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits, PRECISION=_PRECISION)
    if parts is not None:
        _combine_kernel[(num_seqs, num_heads)](*parts, out, out.stride(0), out.stride(1), num_heads,
                                               HEAD_DIM=head_dim, NUM_SPLITS=num_splits)
    return out


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start, out, qk_scale, first_seq,
                    q_stride_t, q_stride_h, bt_stride, cache_stride_block, cache_stride_slot, cache_stride_head,
                    out_stride_t, out_stride_h,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start + seq).to(tl.int32)
    query_len = tl.load(query_start + seq + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens + seq).to(tl.int32)
    prefix = context_len - query_len
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = prefix + rows
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    token_rows = (q_start + rows).to(tl.int64)
    query = tl.load(q + token_rows[:, None] * q_stride_t + head * q_stride_h + dims[None, :], mask=row_mask[:, None],
                    other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the tile's last query position; none for a tile past the request's queries.
    hi = tl.where(tile * BLOCK_M < query_len, tl.minimum(context_len, prefix + (tile + 1) * BLOCK_M), 0)
    table = block_tables + seq.to(tl.int64) * bt_stride
    for start in range(0, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < hi
        # Every row sees token 0 in the first tile, so its running maximum is finite from there on.
        visible = valid[None, :] & (tokens[None, :] <= positions[:, None])
        m_i, l_i, acc = _attend_tile(query, k_cache, v_cache, table, tokens, valid, visible, kv_head, dims, m_i, l_i,
                                     acc, qk_scale, cache_stride_block, cache_stride_slot, cache_stride_head,
                                     BLOCK_SIZE, PRECISION)
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + token_rows[:, None] * out_stride_t + head * out_stride_h + dims[None, :],
             result.to(out.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start: torch.Tensor, first_seq: int, num_seqs: int,
                  max_query_len: int, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of requests first_seq .. first_seq + num_seqs - 1 of a packed batch: request r's queries are
    q[query_start[r]:query_start[r + 1]] ([tokens, heads, head_dim]), the last of its context_lens[r] positions,
    their K/V already in the cache. Writes their rows of `out` (like q) and returns it; max_query_len bounds every
    request's query count (it sizes the grid)."""
    block_size, kv_heads, head_dim = _check_cache(q, k_cache, v_cache)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"paged prefill: out {tuple(out.shape)} must be q's shape {tuple(q.shape)}, head_dim "
                         "contiguous")
    if num_seqs == 0 or max_query_len == 0:
        return out
    num_heads = q.shape[1]
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out, _LOG2E / math.sqrt(head_dim), first_seq,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N, PRECISION=_PRECISION)
    return out
