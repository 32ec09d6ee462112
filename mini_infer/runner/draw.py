"""The draw of a sampled token: from each row's temperature-scaled logits, min_p, top_k and top_p by inverse CDF over
the row's likeliest candidates (or its sorted vocabulary where a nucleus reaches past them); and how the candidates are
found (torch.topk, or the native top-k with equals in id order, which deterministic mode takes).
Probabilities come from softmax and cumsum, which reduce a row alone in one order whatever the batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The runner's top-k where its native kernels run: logits [R, V] (as they are), k per row [R], edits (ids [R, W],
# values [R, W]: entries to read instead) -> (values float32, ids) of each row's k largest, best first ([R, max k],
# a shorter row padded with -inf), ties broken towards the lower id as argmax does.
TopK = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Each row's k largest entries of x [R, C], best first: (values, ids) [R, k].
Largest = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def torch_largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.topk(k, dim=-1)


def ties_to_lower_ids(top_k: TopK) -> Largest:
    """Largest through the native top-k, which puts equal values in id order whatever the batch's shape (torch.topk
    orders equals as it splits the work: a bfloat16 model's tied logprobs came out in another order alone)."""
    def largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        none = torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
        return top_k(x, torch.full((x.shape[0],), k, dtype=torch.int64, device=x.device), none,
                      none.to(torch.float32))
    return largest


# A row with top_p but no top_k looks for its nucleus among this many of its likeliest tokens before sorting all.
CANDIDATES = 1024


@dataclass(slots=True)
class Filters:
    top_k: torch.Tensor  # [n], the vocabulary size when off
    top_p: torch.Tensor  # [n]
    log_min_p: torch.Tensor  # [n], -inf when off

    def rows(self, index: torch.Tensor) -> Filters:
        return Filters(self.top_k[index], self.top_p[index], self.log_min_p[index])


def draw(scaled: torch.Tensor, filters: Filters, u: torch.Tensor, kinds: list[str], kept: list[int],
          largest: Largest = torch_largest, invariant: bool = False) -> torch.Tensor:
    """Sample a token per row of temperature-scaled logits, after min_p, top_k and top_p, by inverse CDF.

    Rows are grouped by their kind (Sampler._draw_kind, known on the host, so no value on the device decides a branch):
    top_k rows draw from their top-k likeliest tokens, found without a sort of the vocabulary; top_p rows from their
    CANDIDATES likeliest, unless their nucleus reaches past those (the one case read back from the device: those
    rows then sort); sorted rows sort the vocabulary; plain rows draw from it whole. `kept`: each row's top_k, the
    vocabulary size when off. Probabilities come from softmax and cumsum, which reduce a row alone in one order.
    `largest` finds the candidates. `invariant` (deterministic mode, with a `largest` that puts equals in id order):
    top_k rows take CANDIDATES of them, not the group's largest top_k, and sorted rows sort stably, so that no width
    or order depends on the batch."""
    n, vocab = scaled.shape
    # min_p keeps p >= min_p * p_max, that is logit >= max logit + log(min_p).
    threshold = scaled.amax(dim=-1) + filters.log_min_p
    tokens = torch.empty(n, dtype=torch.int64, device=scaled.device)

    def rows_of(kind: str) -> list[int]:
        return [i for i, each in enumerate(kinds) if each == kind]

    def index(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=scaled.device)

    if rows := rows_of("plain"):
        at = index(rows)
        tokens[at] = _draw_plain(scaled[at], threshold[at], u[at])
    if rows := rows_of("top_k"):
        at = index(rows)
        width = min(vocab, CANDIDATES) if invariant else max(kept[i] for i in rows)
        values, ids = largest(scaled[at], width)
        tokens[at], _ = draw_candidates(values, ids, threshold[at], filters.rows(at), u[at], vocab)
    sorted_rows = index(rows_of("sorted"))
    if rows := rows_of("top_p"):
        at = index(rows)
        values, ids = largest(scaled[at], min(vocab, CANDIDATES))
        picked, exact = draw_candidates(values, ids, threshold[at], filters.rows(at), u[at], vocab, scaled[at])
        tokens[at] = picked
        sorted_rows = torch.cat([sorted_rows, at[~exact]])  # the nuclei past their candidates, redrawn sorted
    if len(sorted_rows):
        tokens[sorted_rows] = _draw_sorted(scaled[sorted_rows], threshold[sorted_rows], filters.rows(sorted_rows),
                                           u[sorted_rows], stable=invariant)
    return tokens


def draw_candidates(values, ids, threshold, filters: Filters, u, vocab: int,
                     scaled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row, whether the row's draw is exact: its whole nucleus lies among its candidates), from each
    row's likeliest tokens `ids` and their temperature-scaled logits `values` [n, width], best first. Where a row
    without top_k may have candidates that leave out part of the vocabulary, `scaled` holds the whole rows, for the
    kept mass."""
    width = values.shape[1]
    keep = (torch.arange(width, device=values.device) < filters.top_k[:, None]) & (values >= threshold[:, None])
    keep[:, 0] = True
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    unlimited = filters.top_k >= vocab
    if scaled is not None and unlimited.any():  # a candidate's probability among the whole kept vocabulary
        probs[unlimited] = _kept_softmax(scaled[unlimited], threshold[unlimited]).gather(1, ids[unlimited])
    cdf = probs.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    nucleus = filters.top_p < 1
    keep &= ~nucleus[:, None] | (cdf - probs < filters.top_p[:, None])
    keep[:, 0] = True  # the most likely token always stays, even where top_p rounds to 0 in this dtype
    exact = ~unlimited | (cdf[:, -1] >= filters.top_p) | (values[:, -1] < threshold)
    return ids.gather(1, _inverse_cdf(probs * keep, u)[:, None])[:, 0], exact


def _kept_softmax(scaled: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Each row's softmax over the tokens at or above its min_p threshold (the others 0)."""
    return torch.softmax(scaled.masked_fill(scaled < threshold[:, None], float("-inf")), dim=-1)


def _draw_plain(scaled, threshold, u) -> torch.Tensor:
    """Rows without top_k or top_p: the draw over the whole vocabulary (min_p's threshold applied)."""
    return _inverse_cdf(_kept_softmax(scaled, threshold), u)


def _draw_sorted(scaled, threshold, filters: Filters, u, stable: bool = False) -> torch.Tensor:
    """Rows whose top-k or nucleus needs the vocabulary sorted: the draw over it in rank order (`stable`: equals in id
    order)."""
    sorted_probs, order = _kept_softmax(scaled, threshold).sort(dim=-1, descending=True, stable=stable)
    drop = torch.arange(scaled.shape[1], device=scaled.device)[None, :] >= filters.top_k[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0)
    cdf = sorted_probs.cumsum(dim=-1)
    mass_before = (cdf - sorted_probs) / cdf[:, -1:]  # of the mass top_k keeps
    top_p = filters.top_p[:, None]
    drop = (top_p < 1) & (mass_before >= top_p)
    drop[:, 0] = False
    picked = _inverse_cdf(sorted_probs.masked_fill(drop, 0), u)
    return order.gather(1, picked[:, None])[:, 0]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] < u * total <= cdf[i]: index i drawn with probability weights[i] / total
    (u in (0, 1], so a zero weight is never drawn)."""
    cdf = weights.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target)[:, 0].clamp_(max=weights.shape[1] - 1)
