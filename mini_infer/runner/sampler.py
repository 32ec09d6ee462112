"""Sampler: logits -> next token ids, vectorised over the batch with per-request parameters.

Order (as in vLLM): min_tokens mask, penalties, greedy argmax; then temperature, min_p, top_k, top_p and a
draw. A draw is argmax(probs / E) with E ~ Exponential(1), which picks token i with probability probs[i];
requests with a seed draw E from their own generator, so their samples do not depend on the batch.
Logprobs are those of the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_infer.engine.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # For rows that asked for logprobs (else None): sampled token's logprob and rank, and the top-N.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logits = logits[:, : self.vocab_size].to(torch.promote_types(logits.dtype, torch.float32))
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._mask_stop_tokens_under_min(logits, requests)
        if any(r.params.uses_penalties for r in requests):
            logits = self._apply_penalties(logits, requests)
        tokens = logits.argmax(dim=-1)
        if not all(r.params.greedy for r in requests):
            tokens = self._sample(logits, tokens, requests)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _gather_logprobs(raw_logprobs, tokens, requests))

    def _mask_stop_tokens_under_min(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows, cols = [], []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.params.min_tokens:
                stop_ids = [t for t in (*r.eos_token_ids, *r.params.stop_token_ids) if t < self.vocab_size]
                rows.extend([i] * len(stop_ids))
                cols.extend(stop_ids)
        if rows:
            logits = logits.index_put((torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)),
                                      torch.tensor(float("-inf"), dtype=logits.dtype, device=self.device))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        def column(values):
            return torch.tensor(values, dtype=logits.dtype, device=self.device)[:, None]

        output_counts = self._token_counts([r.output_token_ids for r in requests])
        prompt_seen = self._token_counts([r.prompt_token_ids for r in requests]) > 0
        repetition = column([r.params.repetition_penalty for r in requests])
        seen = prompt_seen | (output_counts > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
        logits = logits - column([r.params.frequency_penalty for r in requests]) * output_counts
        return logits - column([r.params.presence_penalty for r in requests]) * (output_counts > 0)

    def _token_counts(self, token_lists: list[list[int]]) -> torch.Tensor:
        """[batch, vocab] occurrence counts, from one padded tensor (the pad column is dropped)."""
        width = max(map(len, token_lists), default=0)
        padded = torch.tensor([t + [self.vocab_size] * (width - len(t)) for t in token_lists],
                              dtype=torch.int64, device=self.device).view(len(token_lists), width)
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, device=self.device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
        return counts[:, : self.vocab_size]

    def _sample(self, logits: torch.Tensor, greedy_tokens: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                   dtype=logits.dtype, device=self.device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            probs = logits.softmax(dim=-1)
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=self.device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None and not r.params.greedy:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    def _top_k_top_p(self, logits: torch.Tensor, params) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=self.device)
        ranks = torch.arange(self.vocab_size, device=self.device)[None, :]
        drop = ranks >= top_k[:, None]
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=self.device)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, requests: list[Request]):
    if raw_logprobs is None:
        return [None] * len(requests)
    sampled = raw_logprobs.gather(1, tokens[:, None])
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    num_top = max(r.params.logprobs or 0 for r in requests)
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    sampled, ranks = sampled[:, 0].tolist(), ranks.tolist()
    result = []
    for i, r in enumerate(requests):
        n = r.params.logprobs
        if n is None:
            result.append(None)
            continue
        ids = top_ids[i, :n].tolist() if n else []
        values = top_values[i, :n].tolist() if n else []
        result.append((sampled[i], ranks[i], ids, values))
    return result
