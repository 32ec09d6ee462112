"""Sampler: logits -> next token ids, vectorised over the batch with per-request parameters held per slot.

Each slot of the persistent batch keeps its request's sampling parameters as tensor rows and, for penalised
requests, its prompt-token mask and output-token counts, updated as tokens arrive; a step gathers the rows of the
requests it samples, so its host work is O(batch) whatever the context length.

Order (as in vLLM): min_tokens mask, penalties, greedy argmax; then temperature, min_p, top_k, top_p and a
draw. A draw is argmax(probs / E) with E ~ Exponential(1), which picks token i with probability probs[i];
requests with a seed draw E from their own generator, so their samples do not depend on the batch.
Logprobs are those of the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_infer.runner.plan import NewRequest
from mini_infer.sampling_params import SamplingParams

# Per-slot parameter rows: name -> the value a request's SamplingParams gives it.
_ROWS = {
    "temperature": lambda p: 1.0 if p.greedy else p.temperature,
    "min_p": lambda p: p.min_p,
    "top_p": lambda p: p.top_p,
    "repetition": lambda p: p.repetition_penalty,
    "frequency": lambda p: p.frequency_penalty,
    "presence": lambda p: p.presence_penalty,
}


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
        self._capacity = 0
        self._rows: dict[str, torch.Tensor] = {}
        self._top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self._params: list[SamplingParams | None] = []
        self._stop_ids: list[tuple[int, ...]] = []  # masked while the slot has fewer than min_tokens outputs
        self._num_outputs: list[int] = []
        self._slot_generators: list[torch.Generator | None] = []
        self._generators: dict[str, torch.Generator] = {}  # seeded requests, kept while preempted
        # Penalty state, allocated when a penalised request first arrives: [slots, vocab].
        self._output_counts: torch.Tensor | None = None
        self._prompt_seen: torch.Tensor | None = None

    # ---- the batch's slots ----

    def add(self, request: NewRequest) -> None:
        slot, params = request.slot, request.params
        self._grow(slot + 1)
        for name, value in _ROWS.items():
            self._rows[name][slot] = value(params)
        # A top_k past the vocabulary (even past int64) keeps every token, as vLLM clamps it.
        self._top_k[slot] = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size
        self._params[slot] = params
        self._stop_ids[slot] = tuple(t for t in request.min_tokens_stop_ids if t < self.vocab_size)
        self._num_outputs[slot] = len(request.token_ids) - request.num_prompt_tokens
        generator = None
        if params.seed is not None:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[request.request_id] = generator
        self._slot_generators[slot] = generator
        if params.uses_penalties:
            self._set_penalty_rows(slot, request)

    def release(self, request_id: str, slot: int | None, finished: bool) -> None:
        """The request left its slot; a finished one also drops its seeded generator (a preempted one keeps it
        for when it comes back)."""
        if slot is not None:
            self._params[slot] = None
            self._slot_generators[slot] = None
        if finished:
            self._generators.pop(request_id, None)

    def append(self, slots: list[int], token_ids: list[int]) -> None:
        """Tokens the requests in `slots` gained (their sampled ones)."""
        for slot in slots:
            self._num_outputs[slot] += 1
        if self._output_counts is not None and slots:
            index = (torch.tensor(slots, device=self.device), torch.tensor(token_ids, device=self.device))
            self._output_counts.index_put_(index, torch.ones(len(slots), dtype=torch.int32, device=self.device),
                                           accumulate=True)

    def _grow(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        new = max(capacity, 2 * self._capacity, 8)
        extra = new - self._capacity
        for name in _ROWS:
            self._rows[name] = _extend(self._rows.get(name), extra, torch.float64, self.device)
        self._top_k = _extend(self._top_k, extra, torch.int64, self.device)
        self._params += [None] * extra
        self._stop_ids += [()] * extra
        self._num_outputs += [0] * extra
        self._slot_generators += [None] * extra
        if self._output_counts is not None:
            self._output_counts = _extend(self._output_counts, extra, torch.int32, self.device)
            self._prompt_seen = _extend(self._prompt_seen, extra, torch.bool, self.device)
        self._capacity = new

    def _set_penalty_rows(self, slot: int, request: NewRequest) -> None:
        if self._output_counts is None:
            shape = (self._capacity, self.vocab_size)
            self._output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        tokens = torch.tensor(request.token_ids, dtype=torch.int64, device=self.device)
        prompt, output = tokens[: request.num_prompt_tokens], tokens[request.num_prompt_tokens:]
        self._prompt_seen[slot] = False
        self._prompt_seen[slot, prompt[prompt < self.vocab_size]] = True
        self._output_counts[slot] = torch.bincount(output[output < self.vocab_size], minlength=self.vocab_size)

    # ---- sampling ----

    def __call__(self, logits: torch.Tensor, slots: list[int]) -> SamplerOutput:
        """Sample one token for each row of `logits`, row i belonging to the request in slots[i]."""
        params = [self._params[s] for s in slots]
        logits = logits[:, : self.vocab_size].to(torch.promote_types(logits.dtype, torch.float32))
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.mask_stop_tokens_under_min(logits, slots)
        index = torch.tensor(slots, device=self.device)
        if any(p.uses_penalties for p in params):
            logits = self.apply_penalties(logits, slots)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            tokens = self._sample(logits, tokens, slots, index, params)
        return SamplerOutput(tokens.tolist(), _gather_logprobs(raw_logprobs, tokens, params))

    def mask_stop_tokens_under_min(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """-inf on the stop token ids of the rows whose requests have fewer than min_tokens outputs."""
        rows, cols = [], []
        for i, slot in enumerate(slots):
            if self._num_outputs[slot] < self._params[slot].min_tokens:
                rows.extend([i] * len(self._stop_ids[slot]))
                cols.extend(self._stop_ids[slot])
        if rows:
            logits = logits.index_put((torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)),
                                      torch.tensor(float("-inf"), dtype=logits.dtype, device=self.device))
        return logits

    def apply_penalties(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Repetition penalty on tokens of the prompt or the output, presence and frequency on the output."""
        index = torch.tensor(slots, device=self.device)

        def column(name):
            return self._rows[name][index].to(logits.dtype)[:, None]

        output_counts = self._output_counts[index].to(logits.dtype)
        seen = self._prompt_seen[index] | (output_counts > 0)
        repetition = column("repetition")
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
        logits = logits - column("frequency") * output_counts
        return logits - column("presence") * (output_counts > 0)

    def _sample(self, logits: torch.Tensor, greedy_tokens: torch.Tensor, slots: list[int], index: torch.Tensor,
                params: list[SamplingParams]) -> torch.Tensor:
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        logits = logits / self._rows["temperature"][index].to(logits.dtype)[:, None]
        if any(p.min_p > 0 for p in params):
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * self._rows["min_p"][index].to(logits.dtype)[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, index)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (slot, p) in enumerate(zip(slots, params)):
            if self._slot_generators[slot] is not None and not p.greedy:
                noise[i].exponential_(generator=self._slot_generators[slot])
        # exponential_ can return 0.0, and p / 0 would make any token, even one of probability 0, the argmax.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    def _top_k_top_p(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(self.vocab_size, device=self.device)[None, :]
        drop = ranks >= self._top_k[index][:, None]
        top_p = self._rows["top_p"][index].to(logits.dtype)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays, even where top_p rounds to 0 in this dtype
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _extend(tensor: torch.Tensor | None, extra: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`tensor` with `extra` zero rows appended (a new one when None)."""
    if tensor is None:
        return torch.zeros(extra, dtype=dtype, device=device)
    return torch.cat([tensor, torch.zeros((extra, *tensor.shape[1:]), dtype=dtype, device=device)])


def _gather_logprobs(raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, params: list[SamplingParams]):
    if raw_logprobs is None:
        return [None] * len(params)
    sampled = raw_logprobs.gather(1, tokens[:, None])
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    num_top = max(p.logprobs or 0 for p in params)
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    sampled, ranks = sampled[:, 0].tolist(), ranks.tolist()
    result = []
    for i, p in enumerate(params):
        n = p.logprobs
        if n is None:
            result.append(None)
            continue
        ids = top_ids[i, :n].tolist() if n else []
        values = top_values[i, :n].tolist() if n else []
        result.append((sampled[i], ranks[i], ids, values))
    return result
