"""Penalties: the per-slot state of penalised requests and the repetition / presence / frequency penalties.

Each slot keeps the ids of the tokens its request has seen (prompt and output, each once; their set on the host too,
so a step never reads the device back) and its output-token counts, all updated as tokens arrive. A step reads and
rewrites the logits at the seen ids only: O(batch x distinct tokens seen), not O(batch x vocabulary).
"""

from __future__ import annotations

import torch


class Penalties:
    def __init__(self, vocab_size: int, capacity: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)  # output tokens
        self.seen_ids = torch.zeros(capacity, 64, dtype=torch.int64, device=device)  # the seen tokens, once each
        # The same on the host: which tokens each slot has seen (prompt or output), so that a step never reads the
        # device back to learn whether a token is new.
        self.seen: list[set[int]] = [set() for _ in range(capacity)]

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self.seen)
        if extra > 0:
            self.counts, self.seen_ids = (_extend_rows(t, extra) for t in (self.counts, self.seen_ids))
            self.seen += [set() for _ in range(extra)]

    def reset(self, slot: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The slot's new request, with its prompt and any outputs it already has."""
        in_vocab = [t for t in token_ids if t < self.vocab_size]
        output = [t for t in token_ids[num_prompt_tokens:] if t < self.vocab_size]
        self.counts[slot] = 0
        if output:
            self.counts[slot].index_add_(0, torch.tensor(output, dtype=torch.int64, device=self.device),
                                         torch.ones(len(output), dtype=torch.int32, device=self.device))
        unique = sorted(set(in_vocab))
        self.seen[slot] = set(unique)
        self._columns(len(unique))
        self.seen_ids[slot, : len(unique)] = torch.tensor(unique, dtype=torch.int64, device=self.device)

    def append(self, slots: list[int], token_ids: list[int]) -> None:
        """Output tokens the requests in `slots` gained (one entry per token)."""
        if not slots:
            return
        rows = torch.tensor(slots, device=self.device)
        tokens = torch.tensor(token_ids, device=self.device)
        self.counts.index_put_((rows, tokens), torch.ones(len(slots), dtype=torch.int32, device=self.device),
                               accumulate=True)
        new_rows, columns, new_tokens = [], [], []
        for slot, token in zip(slots, token_ids):
            if token not in self.seen[slot]:
                new_rows.append(slot)
                columns.append(len(self.seen[slot]))
                new_tokens.append(token)
                self.seen[slot].add(token)
        if new_rows:
            self._columns(max(len(self.seen[s]) for s in new_rows))
            self.seen_ids[torch.tensor(new_rows, device=self.device), torch.tensor(columns, device=self.device)] = \
                torch.tensor(new_tokens, device=self.device)

    def _columns(self, needed: int) -> None:
        width = self.seen_ids.shape[1]
        if needed > width:
            grown = torch.zeros(len(self.seen), max(needed, 2 * width), dtype=torch.int64, device=self.device)
            grown[:, :width] = self.seen_ids
            self.seen_ids = grown

    def penalised(self, logits: torch.Tensor, slots: list[int], repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor, dtype: torch.dtype,
                  ahead: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [R, W], values [R, W]): the tokens each row's request has seen and their logits after the repetition
        penalty (prompt or output tokens) and presence and frequency (output tokens), computed in `dtype`, as are
        the penalty columns [R, 1]. The logits are only read. `ahead` [R, A] (-1 pads): output tokens each row
        follows that its slot has not counted (a verify step's drafts before the row's position): seen, and
        counted, too."""
        num_seen = [len(self.seen[s]) for s in slots]
        width = max(num_seen)
        index = torch.tensor(slots, device=self.device)
        ids = self.seen_ids[index, :width]
        # Rows with fewer seen tokens repeat their first id: the same value written twice to the same place.
        ids = torch.where(torch.arange(width, device=self.device) < torch.tensor(num_seen, device=self.device)[:, None],
                          ids, ids[:, :1])
        if ahead is not None:  # (a token ahead that the slot has seen too is the same value written twice again)
            ids = torch.cat([ids, torch.where(ahead >= 0, ahead, ids[:, :1])], dim=1)
        values = logits.gather(1, ids).to(dtype)
        counts = self.counts[index[:, None], ids]
        if ahead is not None:
            counts = counts + (ids[:, :, None] == ahead[:, None, :]).sum(dim=-1)
        counts = counts.to(dtype)
        values = torch.where(values > 0, values / repetition, values * repetition)
        return ids, values - frequency * counts - presence * (counts > 0)


def _extend_rows(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([tensor, torch.zeros((extra, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)])
