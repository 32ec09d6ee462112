"""The attention metadata of a flat batch of queries, on the device: shared by the target's steps and a draft
model's."""

from __future__ import annotations

import torch

from mini_infer.model.attention import AttentionMetadata

# On the CPU, a step whose requests compute at most this many tokens each (a verify step's 1 + k positions, k <= 16;
# short prompt chunks) gives every token a row of its own (AttentionMetadata.token_rows): its attention runs through
# the decode kernel, and its layers through the one-call decoder stack, as a decode step's do (docs/decisions/024).
SHORT_QUERY = 17


def attention_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       positions: torch.Tensor, query_start_loc: list[int], context_lens_host: list[int],
                       num_decodes: int, device: torch.device, deterministic: bool) -> AttentionMetadata:
    """AttentionMetadata of queries laid out flat (requests with one query token first, `num_decodes` of them):
    with prompt chunks (several tokens a request), also their offsets for the GPU's prefill and, in deterministic
    mode or where every request's query is short on the CPU, each token's block-table row and context length."""
    to = dict(device=device, non_blocking=True)
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(**to), block_tables=block_tables.to(**to),
                             context_lens=context_lens.to(**to), query_start_loc=query_start_loc,
                             context_lens_host=context_lens_host, num_decodes=num_decodes)
    if num_decodes < len(context_lens_host):
        meta.query_start = torch.tensor(query_start_loc, dtype=torch.int32).to(**to)
        meta.max_query_len = max(end - start for start, end in zip(query_start_loc[num_decodes:],
                                                                   query_start_loc[num_decodes + 1:]))
        short = device.type == "cpu" and meta.max_query_len <= SHORT_QUERY
        if deterministic or short:  # each token's block-table row and context length (its position + 1)
            owner = torch.repeat_interleave(torch.arange(len(context_lens_host)),
                                            torch.tensor(query_start_loc).diff())
            meta.token_rows = block_tables[owner].to(**to), (positions + 1).to(**to)
    return meta
