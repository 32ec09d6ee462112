"""Paged attention in plain PyTorch: write each new token's K/V into its cache slot, then attend over
each request's context read from the cache through its block table.

The cache of one layer is a [num_blocks, block_size, kv_heads, head_dim] tensor for K and one for V; a slot
is `block_id * block_size + offset`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """How one step's flat batch of tokens maps onto requests and cache slots."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] block ids per request (padding: any valid id)
    context_lens: torch.Tensor  # [num_reqs] tokens in the cache after this step, per request
    query_start_loc: list[int]  # num_reqs + 1 offsets of each request's tokens in the flat batch
    # context_lens as Python ints, where a step has prompt chunks (the torch and CPU prefill walk requests one by one)
    context_lens_host: list[int] | None
    num_decodes: int  # the leading requests with a single query token
    # Where a step has prompt chunks, for the GPU's prefill kernel: query_start_loc on the device, and the most
    # tokens any request computes (it sizes the kernel's grid).
    query_start: torch.Tensor | None = None
    max_query_len: int = 1
    # Deterministic mode, a step with prompt chunks: each token's block-table row [num_tokens, max_blocks] and context
    # length (its position + 1). Every query then runs through the decode kernel, which reduces a token's context in
    # one order whether the token is decoded, prefilled in any chunk or recomputed after preemption.
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_reqs(self) -> int:
        return self.context_lens.shape[0]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V ([num_tokens, kv_heads, head_dim]) at their slots, in place."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# One request's prefill: (q [Lq, heads, head_dim], k_cache, v_cache, its block-table row, its context length).
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    decode: DecodeAttention | None = None, prefill: PrefillAttention | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], causal over each request's context.

    The leading single-token requests (decodes) go through `decode` (q, k_cache, v_cache, block_tables,
    context_lens) in one batch, torch's by default; the others one by one, through `prefill` (torch's SDPA by
    default). With meta.token_rows every token goes through `decode`, as a row of its own."""
    decode, prefill = decode or decode_attention, prefill or prefill_attention
    if meta.token_rows is not None:
        return decode(q, k_cache, v_cache, *meta.token_rows)
    d = meta.num_decodes
    if d == meta.num_reqs:
        return decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens)
    out = torch.empty_like(q)
    if d:
        out[:d] = decode(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d])
    for i in range(d, meta.num_reqs):  # O(batch) host work
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = prefill(q[start:end], k_cache, v_cache, meta.block_tables[i], meta.context_lens_host[i])
    return out


def decode_attention(q, k_cache, v_cache, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per request, all requests in one batched call."""
    num_reqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    keys = k_cache[block_tables].view(num_reqs, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache[block_tables].view(num_reqs, -1, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None]).view(num_reqs, 1, 1, -1)
    # Slots past a request's context were never written (the cache is allocated uninitialised): zero them
    # so that no stray NaN reaches a score or the weighted sum, where masking alone would not cancel it.
    # In place: the gathers above are fresh copies.
    unwritten = ~mask.view(num_reqs, 1, -1, 1)
    keys.masked_fill_(unwritten, 0)
    values.masked_fill_(unwritten, 0)
    # Query head h reads KV head h // group: fold each KV head's query group into the query axis.
    out = F.scaled_dot_product_attention(q.view(num_reqs, kv_heads, group, head_dim), keys, values, attn_mask=mask)
    return out.reshape(num_reqs, heads, head_dim)


def prefill_attention(q, k_cache, v_cache, blocks: torch.Tensor, context_len: int) -> torch.Tensor:
    """One request over its whole context: the tokens it just wrote and any earlier ones already in the cache (a
    cached prefix, earlier chunks); query i sits at position context_len - query_len + i and sees the keys up to
    it."""
    query_len, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    blocks = blocks[: (context_len + block_size - 1) // block_size]
    # Each KV head repeated for its query group, and a batch axis: [1, heads, len, head_dim] is what torch's
    # fused CPU attention takes (3-d or enable_gqa inputs fell back to its unfused math, ~3x slower at 512).
    keys = k_cache[blocks].view(-1, kv_heads, head_dim)[:context_len].repeat_interleave(heads // kv_heads, 1)
    values = v_cache[blocks].view(-1, kv_heads, head_dim)[:context_len].repeat_interleave(heads // kv_heads, 1)
    mask = None
    if query_len != context_len:
        query_positions = torch.arange(context_len - query_len, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_positions[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None,
    )[0].transpose(0, 1)
