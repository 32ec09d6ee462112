"""Penalties: the per-slot state of penalised requests and the repetition / presence / frequency penalties.

Each slot keeps the ids of the tokens its request has seen (prompt and output, each once), a mask of them, and
its output-token counts, all updated as tokens arrive. A step reads and rewrites the logits at the seen ids only:
O(batch x distinct tokens seen), not O(batch x vocabulary).
"""

from __future__ import annotations

import torch


class Penalties:
    def __init__(self, vocab_size: int, capacity: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)  # output tokens
        self.seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)  # prompt or output
        self.seen_ids = torch.zeros(capacity, 64, dtype=torch.int64, device=device)  # the seen tokens, once each
        self.num_seen = [0] * capacity

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self.num_seen)
        if extra > 0:
            self.counts, self.seen, self.seen_ids = (_extend_rows(t, extra) for t in (self.counts, self.seen,
                                                                                      self.seen_ids))
            self.num_seen += [0] * extra

    def reset(self, slot: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The slot's new request, with its prompt and any outputs it already has."""
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        tokens = tokens[tokens < self.vocab_size]
        output = torch.tensor(token_ids[num_prompt_tokens:], dtype=torch.int64, device=self.device)
        self.counts[slot] = torch.bincount(output[output < self.vocab_size], minlength=self.vocab_size)
        unique = tokens.unique()
        self.seen[slot] = False
        self.seen[slot, unique] = True
        self._columns(len(unique))
        self.seen_ids[slot, : len(unique)] = unique
        self.num_seen[slot] = len(unique)

    def append(self, slots: list[int], token_ids: list[int]) -> None:
        """Output tokens the requests in `slots` gained (one entry per token)."""
        if not slots:
            return
        rows = torch.tensor(slots, device=self.device)
        tokens = torch.tensor(token_ids, device=self.device)
        self.counts.index_put_((rows, tokens), torch.ones(len(slots), dtype=torch.int32, device=self.device),
                               accumulate=True)
        new = (~self.seen[rows, tokens]).tolist()
        self.seen[rows, tokens] = True
        columns = []
        for slot, is_new in zip(slots, new):  # a token gained twice in one step is listed twice: harmless
            columns.append(self.num_seen[slot])
            self.num_seen[slot] += is_new
        self._columns(max(self.num_seen[s] for s in slots))
        keep = torch.tensor(new, device=self.device)
        self.seen_ids[rows[keep], torch.tensor(columns, device=self.device)[keep]] = tokens[keep]

    def _columns(self, needed: int) -> None:
        width = self.seen_ids.shape[1]
        if needed > width:
            grown = torch.zeros(len(self.num_seen), max(needed, 2 * width), dtype=torch.int64, device=self.device)
            grown[:, :width] = self.seen_ids
            self.seen_ids = grown

    def penalised(self, logits: torch.Tensor, slots: list[int], repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [R, W], values [R, W]): the tokens each row's request has seen and their logits after the repetition
        penalty (prompt or output tokens) and presence and frequency (output tokens), computed in `dtype`, as are
        the penalty columns [R, 1]. The logits are only read."""
        width = max(self.num_seen[s] for s in slots)
        index = torch.tensor(slots, device=self.device)
        ids = self.seen_ids[index, :width]
        # Rows with fewer seen tokens repeat their first id: the same value written twice to the same place.
        ids = torch.where(torch.arange(width, device=self.device) < torch.tensor(
            [self.num_seen[s] for s in slots], device=self.device)[:, None], ids, ids[:, :1])
        values = logits.gather(1, ids).to(dtype)
        counts = self.counts[index[:, None], ids].to(dtype)
        values = torch.where(values > 0, values / repetition, values * repetition)
        return ids, values - frequency * counts - presence * (counts > 0)


def _extend_rows(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([tensor, torch.zeros((extra, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)])
