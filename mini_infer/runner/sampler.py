"""Sampler: logits -> next token ids, vectorised over the batch with per-request parameters held per slot.

Each slot of the persistent batch keeps its request's sampling parameters as tensor rows and, for penalised
requests, the tokens it has seen and its output-token counts (runner/penalties.py), updated as tokens arrive; a
step gathers the rows of the requests it samples, so its host work is O(batch) whatever the context length.

Order (as in vLLM): the structured-output bitmask (tokens a request's grammar forbids get -inf), logit_bias,
min_tokens mask, penalties, greedy argmax; then temperature, min_p, top_k, top_p and a draw by inverse CDF from one
uniform per row (runner/draw.py); requests with a seed draw it from their own generator, so their samples do not
depend on the batch. top_k and top_p work on each row's likeliest tokens, not a sort of the whole vocabulary, unless
the nucleus reaches past them. logit_bias is added in one scatter over the batch's biased entries.
Where the runner gives it a top-k (its native kernel) and every row is greedy or has a top_k of at most CANDIDATES
(the model's generation_config defaults have top_k 20), a step reads the logits once: penalties and min_tokens masks
become sparse edits that the top-k reads in place of the logits at those ids, and temperature, min_p, top_p and the
draw work on the k candidates only (no float32 copy, temperature pass or sort of the vocabulary-wide rows); a batch
with a logit_bias or a grammar takes the full path.
Logprobs are those of the raw model logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mini_infer.runner.draw import (CANDIDATES, Filters, Largest, TopK, draw, draw_candidates, ties_to_lower_ids,
                                    torch_largest)
from mini_infer.runner.penalties import Penalties
from mini_infer.runner.plan import GrammarBitmask, NewRequest
from mini_infer.sampling_params import SamplingParams

# The runner's structured-output bitmask where its native kernels run: (logits float32 [R, V], rows, bitmask int32
# [R, words]) -> the logits, the rows' forbidden tokens set to -inf in place.
MaskRows = Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor]

# Per-slot parameter rows: name -> the value a request's SamplingParams gives it.
_ROWS = {
    "temperature": lambda p: 1.0 if p.greedy else p.temperature,
    "log_min_p": lambda p: math.log(p.min_p) if p.min_p > 0 else -math.inf,  # on the host: one rounding, any batch
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
    # Requests' prompt logprobs computed this step: request id -> (first scored prompt position, per position
    # (prompt token, its logprob, rank, the top-N ids, their logprobs)).
    prompt_logprobs: dict[str, tuple[int, list[tuple[int, float, int, list[int], list[float]]]]] | None = None
    # Speculative decoding: per request that sampled, in order, how many of token_ids (and logprobs) are its own
    # (its accepted drafts and one more; None: one each), and the drafts proposed for its next step.
    num_emitted: list[int] | None = None
    draft_token_ids: list[list[int]] | None = None
    draft_seconds: float = 0.0  # the proposer's time this step (the scheduler prices drafts by it)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, owners: list[tuple[str, int, int, int]],
                    vocab_size: int, largest: Largest = torch_largest,
                    ) -> dict[str, tuple[int, list[tuple[int, float, int, list[int], list[float]]]]]:
    """Log-softmax of the prompt rows' logits [P, >= vocab] (float32 at least), each row's target token's logprob
    and rank, and the top-N of each owner's rows (owners: request id, first position, rows, N; in row order)."""
    rows = torch.log_softmax(logits[:, :vocab_size].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = rows.gather(1, targets[:, None])[:, 0]
    ranks = ((rows > chosen[:, None]).sum(dim=-1) + 1).tolist()
    num_top = max(n for *_, n in owners)
    top_values, top_ids = largest(rows, num_top) if num_top else (rows[:, :0], rows[:, :0].long())
    chosen, top_values, top_ids, targets = chosen.tolist(), top_values.tolist(), top_ids.tolist(), targets.tolist()
    result, at = {}, 0
    for request_id, first, count, n in owners:
        result[request_id] = (first, [(targets[r], chosen[r], ranks[r], top_ids[r][:n], top_values[r][:n])
                                      for r in range(at, at + count)])
        at += count
    return result


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None, top_k: TopK | None = None,
                 mask_rows: MaskRows | None = None, invariant: bool = False) -> None:
        """invariant (deterministic mode): every sampled row takes the full path with candidates of one width,
        so that a row's draw never depends on the rest of its batch (the top-k path's width is the batch's largest
        top_k)."""
        self.vocab_size = vocab_size
        self.invariant = invariant
        if invariant and top_k is None:
            raise ValueError("deterministic needs the native top-k kernel (top_k_rows): torch.topk orders equal "
                             "values differently in different batches")
        self.largest = ties_to_lower_ids(top_k) if invariant else torch_largest
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))  # rows [R, V] -> int64 [R]; the runner's may be native
        self.top_k = top_k
        self.mask_rows = mask_rows
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._capacity = 0
        self._rows: dict[str, torch.Tensor] = {}
        self._top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self._params: list[SamplingParams | None] = []
        self._stop_ids: list[tuple[int, ...]] = []  # masked while the slot has fewer than min_tokens outputs
        self._bias: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # a slot's logit_bias: (ids, values)
        self._num_outputs: list[int] = []
        self._slot_generators: list[torch.Generator | None] = []
        self._generators: dict[str, torch.Generator] = {}  # seeded requests, kept while preempted
        self._penalties: Penalties | None = None  # allocated when a penalised request first arrives

    # ---- the batch's slots ----

    def add(self, request: NewRequest) -> None:
        slot, params = request.slot, request.params
        self._grow(slot + 1)
        for name, value in _ROWS.items():
            self._rows[name][slot] = value(params)
        self._top_k[slot] = self._kept(params)
        self._params[slot] = params
        self._stop_ids[slot] = tuple(t for t in request.min_tokens_stop_ids if t < self.vocab_size)
        bias = params.logit_bias
        self._bias[slot] = None if not bias else (
            torch.tensor(list(bias), dtype=torch.int64, device=self.device),
            torch.tensor(list(bias.values()), dtype=torch.float64, device=self.device))
        self._num_outputs[slot] = len(request.token_ids) - request.num_prompt_tokens
        generator = None
        if params.seed is not None:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[request.request_id] = generator
        self._slot_generators[slot] = generator
        if params.uses_penalties:
            if self._penalties is None:
                self._penalties = Penalties(self.vocab_size, self._capacity, self.device)
            self._penalties.reset(slot, request.token_ids, request.num_prompt_tokens)

    def _kept(self, params: SamplingParams) -> int:
        """How many tokens a request's top_k keeps: past the vocabulary (even past int64) every token, as vLLM clamps
        it; 0 or -1 (off) every token too."""
        return min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size

    def release(self, request_id: str, slot: int | None, finished: bool) -> None:
        """The request left its slot; a finished one also drops its seeded generator (a preempted one keeps it
        for when it comes back)."""
        if slot is not None:
            self._params[slot] = None
            self._slot_generators[slot] = None
            self._bias[slot] = None
        if finished:
            self._generators.pop(request_id, None)

    def append(self, slots: list[int], token_ids: list[int]) -> None:
        """Tokens the requests in `slots` gained (their sampled ones)."""
        for slot in slots:
            self._num_outputs[slot] += 1
        if self._penalties is not None:
            penalised = [(s, t) for s, t in zip(slots, token_ids) if self._params[s].uses_penalties]
            self._penalties.append([s for s, _ in penalised], [t for _, t in penalised])

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
        self._bias += [None] * extra
        self._num_outputs += [0] * extra
        self._slot_generators += [None] * extra
        if self._penalties is not None:
            self._penalties.grow(new)
        self._capacity = new

    # ---- sampling ----

    def __call__(self, logits: torch.Tensor, slots: list[int], grammar: GrammarBitmask | None = None,
                 ahead: list[list[int]] | None = None) -> SamplerOutput:
        """Sample one token for each row of `logits`, row i belonging to the request in slots[i]; `grammar` limits
        the tokens of its rows; `ahead[i]`: output tokens row i follows past those its slot has counted (a verify
        step's drafts before that row's position), which its penalties count."""
        tokens, logprobs = self.sample(logits, slots, grammar, ahead)
        return SamplerOutput(tokens.tolist(), logprobs)

    def sample(self, logits: torch.Tensor, slots: list[int], grammar: GrammarBitmask | None = None,
               ahead: list[list[int]] | None = None) -> tuple[torch.Tensor, list]:
        """__call__'s tokens as a tensor on the logits' device (the host waits for nothing unless a row asked for
        logprobs), with the rows' logprobs."""
        params = [self._params[s] for s in slots]
        # The sampler's own copy when anything below edits it in place (the caller's logits stay as they are).
        biased = any(self._bias[s] is not None for s in slots)
        edits = (biased or grammar is not None or not all(p.greedy and not p.uses_penalties for p in params)
                 or any(self._under_min(slots, ahead)))
        wants_logprobs = any(p.logprobs is not None for p in params)
        if not edits and not wants_logprobs:  # plain greedy: the argmax of the logits as they are
            return self.argmax(logits[:, : self.vocab_size]), [None] * len(params)
        if (self.top_k is not None and not self.invariant and not wants_logprobs and not biased and grammar is None
                and all(p.greedy or self._kept(p) <= CANDIDATES for p in params)):
            return self._sample_top_k(logits, slots, params, ahead), [None] * len(params)
        work = logits[:, : self.vocab_size].to(torch.promote_types(logits.dtype, torch.float32), copy=edits)
        raw_logprobs = torch.log_softmax(work, dim=-1) if wants_logprobs else None
        if grammar is not None:
            self.apply_grammar(work, grammar)
        if biased:
            self.apply_logit_bias(work, slots)
        self.mask_stop_tokens_under_min(work, slots, ahead)
        if any(p.uses_penalties for p in params):
            self.apply_penalties(work, slots, ahead)
        if all(p.greedy for p in params):
            tokens = self.argmax(work)
        else:
            tokens = self._sample(work, slots, params)
        return tokens, _gather_logprobs(raw_logprobs, tokens, params, self.largest)

    def apply_grammar(self, logits: torch.Tensor, grammar: GrammarBitmask) -> torch.Tensor:
        """The structured-output bitmask, in place: natively over float32 logits where the runner has the kernel."""
        if self.mask_rows is not None and logits.dtype == torch.float32:
            return self.mask_rows(logits, grammar.rows, grammar.bitmask)
        return apply_bitmask(logits, grammar.rows, grammar.bitmask)

    def apply_logit_bias(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Each row's logit_bias added to its logits, in place, in one scatter."""
        entries = [(i, self._bias[slot]) for i, slot in enumerate(slots) if self._bias[slot] is not None]
        rows = torch.cat([torch.full_like(ids, i) for i, (ids, _) in entries])
        cols = torch.cat([ids for _, (ids, _) in entries])
        values = torch.cat([values for _, (_, values) in entries]).to(logits.dtype)
        return logits.index_put_((rows, cols), values, accumulate=True)

    def _under_min(self, slots: list[int], ahead: list[list[int]] | None) -> list[bool]:
        """Whether each row's position comes before its request's min_tokens-th output (the outputs its slot has
        counted, and those ahead of them for a verify step's row)."""
        ahead = ahead or [()] * len(slots)
        return [self._num_outputs[s] + len(a) < self._params[s].min_tokens for s, a in zip(slots, ahead)]

    def mask_stop_tokens_under_min(self, logits: torch.Tensor, slots: list[int],
                                   ahead: list[list[int]] | None = None) -> torch.Tensor:
        """-inf, in place, on the stop token ids of the rows whose requests have fewer than min_tokens outputs."""
        rows, cols = [], []
        for i, (slot, under) in enumerate(zip(slots, self._under_min(slots, ahead))):
            if under:
                rows.extend([i] * len(self._stop_ids[slot]))
                cols.extend(self._stop_ids[slot])
        if rows:
            logits.index_put_((torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)),
                              torch.tensor(float("-inf"), dtype=logits.dtype, device=self.device))
        return logits

    def apply_penalties(self, logits: torch.Tensor, slots: list[int],
                        ahead: list[list[int]] | None = None) -> torch.Tensor:
        """Repetition penalty on tokens of the prompt or the output, presence and frequency on the output (in
        place)."""
        ids, values = self._penalised(logits, slots, logits.dtype, ahead)
        return logits.scatter_(1, ids, values)

    def _penalised(self, logits: torch.Tensor, slots: list[int], dtype: torch.dtype,
                   ahead: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids [R, W] of the tokens each row's request has seen (and those ahead of its slot's count) and their
        penalised logits in `dtype`."""
        index = torch.tensor(slots, device=self.device)

        def column(name):
            return self._rows[name][index].to(dtype)[:, None]

        extra = None
        if ahead is not None and any(ahead):
            width = max(map(len, ahead))
            extra = torch.tensor([row + [-1] * (width - len(row)) for row in ahead], device=self.device)
        return self._penalties.penalised(logits, slots, column("repetition"), column("frequency"), column("presence"),
                                         dtype, extra)

    def _sample_top_k(self, logits: torch.Tensor, slots: list[int], params: list[SamplingParams],
                      ahead: list[list[int]] | None = None) -> torch.Tensor:
        """Tokens for a batch whose rows are greedy or keep at most CANDIDATES tokens, from each row's top_k (1 when
        greedy) likeliest after its penalties and min_tokens masks, found by `top_k` in one pass over the logits as
        they are (no copy of the vocabulary-wide rows, no sort): temperature, min_p, top_p and the draw then work
        on those candidates only."""
        dtype = torch.promote_types(logits.dtype, torch.float32)  # what the full path computes in
        edit_ids, edit_values = [], []
        if any(p.uses_penalties for p in params):
            ids, values = self._penalised(logits, slots, dtype, ahead)
            edit_ids.append(ids)
            edit_values.append(values)
        stops = [self._stop_ids[s] if under else () for s, under in zip(slots, self._under_min(slots, ahead))]
        width = max(map(len, stops))
        if width:  # min_tokens masks: -inf (an id past the vocabulary pads a row)
            edit_ids.append(torch.tensor([(*ids, *(self.vocab_size,) * (width - len(ids))) for ids in stops],
                                         device=self.device))
            edit_values.append(torch.full((len(slots), width), float("-inf"), dtype=dtype, device=self.device))
        index = torch.tensor(slots, device=self.device)
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        ks = torch.where(greedy, 1, self._top_k[index])
        none = torch.zeros(len(slots), 0, dtype=torch.int64, device=self.device)
        values, ids = self.top_k(logits[:, : self.vocab_size], ks, torch.cat(edit_ids, dim=1) if edit_ids else none,
                                 torch.cat(edit_values, dim=1) if edit_values else none.to(dtype))
        tokens = ids[:, 0].clone()  # a greedy row's only candidate: the argmax
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            picked = index[rows]
            scaled = values[rows].to(dtype) / self._rows["temperature"][picked].to(dtype)[:, None]
            filters = Filters(self._top_k[picked], self._rows["top_p"][picked].to(dtype),
                               self._rows["log_min_p"][picked].to(dtype))
            threshold = scaled[:, 0] + filters.log_min_p  # the row's maximum is its first candidate
            tokens[rows], _ = draw_candidates(scaled, ids[rows], threshold, filters, self._uniforms(
                [slots[i] for i in rows]), self.vocab_size)
        return tokens

    def _sample(self, logits: torch.Tensor, slots: list[int], params: list[SamplingParams]) -> torch.Tensor:
        index = torch.tensor(slots, device=self.device)

        def column(name, rows=index):
            return self._rows[name][rows].to(logits.dtype)

        logits.div_(column("temperature")[:, None])  # greedy rows' temperature is 1: their argmax stays
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        tokens = torch.empty(len(slots), dtype=torch.int64, device=self.device)
        if greedy:
            tokens[greedy] = self.argmax(logits[greedy])
        picked = index[rows]
        filters = Filters(self._top_k[picked], column("top_p", picked), column("log_min_p", picked))
        kinds = [self._draw_kind(params[i]) for i in rows]
        tokens[rows] = draw(logits[rows] if greedy else logits, filters, self._uniforms([slots[i] for i in rows]),
                             kinds, [self._kept(params[i]) for i in rows], self.largest, self.invariant)
        return tokens

    def _draw_kind(self, params: SamplingParams) -> str:
        """How _draw samples a row, decided on the host from its parameters: "plain" (temperature alone, or min_p),
        "top_k" (top_k <= CANDIDATES, top_p too or not), "top_p" (a nucleus without top_k), "sorted" (a larger
        top_k: the row's vocabulary sorted)."""
        kept = self._kept(params)
        if kept < self.vocab_size:
            return "top_k" if kept <= CANDIDATES else "sorted"
        return "top_p" if params.top_p < 1 else "plain"

    def hold_draws(self, slots: list[int]) -> dict[int, torch.Tensor]:
        """Before a verify step samples several positions of each of `slots`: the state of each seeded sampled
        slot's generator, for keep_draws."""
        return {slot: self._slot_generators[slot].get_state() for slot in slots
                if self._slot_generators[slot] is not None and not self._params[slot].greedy}

    def keep_draws(self, held: dict[int, torch.Tensor], used: dict[int, int]) -> None:
        """After the verify step: each held generator as if it had drawn for the `used[slot]` positions the request
        kept and no others, so that a seeded request draws position by position what it draws without
        speculation."""
        for slot, state in held.items():
            generator = self._slot_generators[slot]
            generator.set_state(state)
            for _ in range(used[slot]):
                torch.rand(1, dtype=torch.float64, generator=generator, device=self.device)

    def _uniforms(self, slots: list[int]) -> torch.Tensor:
        """One draw in (0, 1] per row: a seeded request's from its own generator (so its samples do not depend on
        the batch), the others' from the sampler's."""
        u = 1 - torch.rand(len(slots), dtype=torch.float64, generator=self.generator, device=self.device)
        for i, slot in enumerate(slots):
            if self._slot_generators[slot] is not None:
                u[i] = 1 - torch.rand(1, dtype=torch.float64, generator=self._slot_generators[slot],
                                      device=self.device)
        return u


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """-inf, in place, on the tokens that the rows `rows` of `logits` [R, V] may not take (bitmask int32 [R, >= V / 32]
    aligned with the logits' rows; bit j of word w allows token 32 w + j), with torch: the rows' bits unpacked at
    once."""
    index = torch.tensor(rows, device=logits.device)
    words = bitmask[index].to(logits.device)
    allowed = ((words[:, :, None] >> _BITS.to(logits.device)) & 1).view(len(rows), -1)[:, : logits.shape[1]]
    logits[index] = logits[index].masked_fill_(allowed == 0, float("-inf"))
    return logits


def _extend(tensor: torch.Tensor | None, extra: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`tensor` with `extra` zero rows appended (a new one when None)."""
    if tensor is None:
        return torch.zeros(extra, dtype=dtype, device=device)
    return torch.cat([tensor, torch.zeros((extra, *tensor.shape[1:]), dtype=dtype, device=device)])


def _gather_logprobs(raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, params: list[SamplingParams],
                     largest: Largest = torch_largest):
    if raw_logprobs is None:
        return [None] * len(params)
    sampled = raw_logprobs.gather(1, tokens[:, None])
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    num_top = max(p.logprobs or 0 for p in params)
    top_values, top_ids = largest(raw_logprobs, num_top) if num_top else (None, None)
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
