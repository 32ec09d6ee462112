"""Speculative decoding on rank 0: verifying a step's drafts, and the proposers that make the next step's
(docs/decisions/024-speculative-decoding.md).

A verifying request computes its last token and its k drafts in one forward and samples at each of those k + 1
positions as it would without drafts (its grammar's bitmask, logit_bias, temperature, top_k/top_p/min_p, its seeded
generator's next draw). It keeps drafts while each equals the token sampled before it, and then the token sampled at
the first mismatch (or after the last draft): greedy requests get exactly the tokens of plain decoding. Both proposers
propose deterministically (a point mass q on the draft d), and for such a q the standard rejection rule (accept with
min(1, p(d) / q(d)) = p(d), else draw from the residual p minus d, renormalised) is the same law as "accept when the
target's own draw equals d, else keep that draw": so sampled requests keep the target's distribution, and a seeded
request draws, position by position, the uniforms it would draw without speculation.

Proposers, asked after the step for the requests the scheduler names: NgramProposer finds the latest earlier
occurrence of the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and
output and proposes what followed it; DraftModelProposer runs a small model of the same vocabulary greedily, with its
own K/V tensors over the target's blocks (the scheduler allocates k positions past the target's for its lookahead),
catching up from where it last computed (a request whose drafts stopped being asked for is caught up in one chunk
when they are asked for again). The K/V it wrote for its own drafts stay valid where the target kept those drafts
and their block stayed the request's (the one of its last token), so after a verify step that accepted some of
those, it computes only the tokens after them.
"""

from __future__ import annotations

import itertools

from pathlib import Path
from typing import Protocol

import torch

from mini_infer.config import EngineConfig
from mini_infer.distributed.comm import Comm
from mini_infer.model.loader import load_model
from mini_infer.model.ops import select_backend
from mini_infer.runner.input_batch import InputBatch, StepInputs
from mini_infer.runner.metadata import attention_metadata
from mini_infer.runner.plan import GrammarBitmask, StepPlan
from mini_infer.runner.sampler import Sampler, SamplerOutput


def verify(tokens: torch.Tensor, num_drafts: list[int], drafts: list[list[int]]) -> list[int]:
    """How many tokens each request keeps from a verify step: `tokens` [sum(1 + k)] the tokens sampled at each
    request's positions (its last token's, then each draft's), `drafts` the k proposed tokens of each (k =
    num_drafts[i]). A request keeps its leading drafts that equal the token sampled before them, and one more token:
    1 + that many."""
    counts = torch.tensor(num_drafts)
    width = max(num_drafts)
    starts = torch.tensor(_starts(num_drafts))
    columns = torch.arange(width)
    sampled = tokens.cpu()[(starts[:, None] + columns).clamp(max=tokens.shape[0] - 1)]
    proposed = torch.tensor([d + [-1] * (width - len(d)) for d in drafts], dtype=torch.int64).view(-1, width)
    matches = (sampled == proposed) & (columns < counts[:, None])
    return (matches.to(torch.int64).cumprod(1).sum(1) + 1).tolist()


class Proposer(Protocol):
    def reset(self, slot: int) -> None:
        """A request entered `slot` (admitted, or back after preemption)."""

    def propose(self, batch: InputBatch, slots: list[int], lengths: list[int], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for the request in slots[i], whose tokens are the first lengths[i] of its batch row
        (the row holds the step's sampled tokens already)."""


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def reset(self, slot: int) -> None:
        """Nothing is kept between steps."""

    def propose(self, batch: InputBatch, slots: list[int], lengths: list[int], ks: list[int]) -> list[list[int]]:
        return [self._lookup(batch.token_ids[slot, :length], k) for slot, length, k in zip(slots, lengths, ks)]

    def _lookup(self, tokens: torch.Tensor, k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix of `tokens` (lookup_max down to
        lookup_min tokens) that occurred before: up to k tokens, none if no such suffix occurred."""
        length = tokens.shape[0]
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            # windows starting at 0 .. length - n - 1: every occurrence but the suffix itself
            found = (tokens[: length - 1].unfold(0, n, 1) == tokens[length - n:]).all(dim=1).nonzero()
            if len(found):
                start = int(found[-1, 0]) + n
                return tokens[start: start + k].tolist()
        return []


class DraftModelProposer:
    def __init__(self, draft: EngineConfig, num_blocks: int, device: torch.device, vocab_size: int) -> None:
        self.config, self.device = draft, device
        self.vocab_size = min(vocab_size, draft.model_config.vocab_size)  # the ids both models have
        self.ops = select_backend(draft, device)
        mc = draft.model_config
        self.model = load_model(mc, Path(draft.model), dtype=draft.torch_dtype, device=device,
                                max_positions=draft.max_model_len, ops=self.ops, comm=Comm.local(draft))
        shape = (num_blocks, draft.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=draft.torch_dtype, device=device),
                           torch.empty(shape, dtype=draft.torch_dtype, device=device))
                          for _ in range(mc.num_hidden_layers)]
        self.computed: dict[int, int] = {}  # slot -> positions whose draft K/V are written and valid
        # slot -> the drafts whose K/V were written past computed[slot] (valid as far as the request kept them)
        self.ahead: dict[int, list[int]] = {}

    def reset(self, slot: int) -> None:
        # From position 0: blocks taken from the prefix cache hold the target's K/V, not necessarily the draft's.
        self.computed[slot] = 0
        self.ahead.pop(slot, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, slots: list[int], lengths: list[int], ks: list[int]) -> list[list[int]]:
        """Catch each request's draft K/V up to its tokens (its last token's logits give the first draft), then one
        token a step for the rest; the drafts are written ahead in the batch rows, where the next step's input
        reads them (the first draft's input is the request's last token, already there)."""
        drafts: list[list[int]] = [[] for _ in slots]
        for slot, length in zip(slots, lengths):
            self._keep_ahead(batch, slot, length)
        order = sorted(range(len(slots)), key=lambda i: lengths[i] - self.computed[slots[i]] > 1)  # decodes first
        starts = [self.computed[slots[i]] for i in order]
        counts = [lengths[i] - start for i, start in zip(order, starts)]
        tokens = self._forward(batch, [slots[i] for i in order], starts, counts)
        for i, token in zip(order, tokens):
            drafts[i].append(token)
            self.computed[slots[i]] = lengths[i]
        for step in range(1, max(ks)):
            live = [i for i in range(len(slots)) if ks[i] > step]
            batch.write_tokens([(slots[i], lengths[i] + step - 1, [drafts[i][-1]]) for i in live])
            tokens = self._forward(batch, [slots[i] for i in live], [lengths[i] + step - 1 for i in live],
                                   [1] * len(live))
            for i, token in zip(live, tokens):
                drafts[i].append(token)
        for slot, tokens in zip(slots, drafts):
            self.ahead[slot] = tokens[:-1]  # (the last draft was never an input)
        return drafts

    def _keep_ahead(self, batch: InputBatch, slot: int, length: int) -> None:
        """Count as computed the K/V of the slot's last drafts that its tokens (the first `length`) now hold, up to
        the last token, whose logits the next draft needs, and within the block that held its last token when it
        proposed them: the blocks past that one were given back after that step (Scheduler._lookahead's slots) and
        may hold another request's K/V since."""
        ahead = self.ahead.pop(slot, None)
        start = self.computed[slot]
        if not ahead:
            return
        block_end = -(-start // self.config.block_size) * self.config.block_size
        held = batch.token_ids[slot, start: min(start + len(ahead), length - 1, block_end)].tolist()
        self.computed[slot] = start + next((i for i, (a, b) in enumerate(zip(held, ahead)) if a != b), len(held))

    def _forward(self, batch: InputBatch, slots: list[int], starts: list[int], counts: list[int]) -> list[int]:
        """The draft model over counts[i] tokens of slots[i] from starts[i] (requests of one token first): the
        argmax after each request's last one."""
        query = batch.query(slots, starts, counts)
        num_decodes = sum(1 for c in counts if c == 1)
        meta = attention_metadata(query.slot_mapping, query.block_tables, query.context_lens, query.positions,
                                  query.query_start_loc.tolist(), query.context_lens.tolist(), num_decodes,
                                  self.device, self.config.deterministic)
        to = dict(device=self.device, non_blocking=True)
        logits = self.model(query.input_ids.to(**to), query.positions.to(**to), self.kv_caches, meta,
                            (query.query_start_loc[1:] - 1).to(**to))
        return self.ops.argmax(logits[:, : self.vocab_size]).tolist()


class Speculator:
    """Rank 0's part of speculative decoding: sampling a verify step's positions, keeping what verify() accepts, and
    proposing the next step's drafts."""

    def __init__(self, config: EngineConfig, num_blocks: int, device: torch.device) -> None:
        spec = config.speculative_config
        self.proposer: Proposer = (
            NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram"
            else DraftModelProposer(config.draft_config, num_blocks, device, config.model_config.vocab_size))

    def sample(self, sampler: Sampler, logits: torch.Tensor, step: StepInputs, batch: InputBatch,
               grammar: GrammarBitmask | None) -> SamplerOutput:
        """The step's tokens: each sampling request's 1 + k rows sampled as plain decoding would, then cut to the
        tokens it keeps (SamplerOutput.num_emitted); the kept tokens are written into the batch rows, where the
        proposers read them before the next plan brings them."""
        slots, num_drafts = step.sampling_slots, step.num_drafts or [0] * len(step.sampling_slots)
        rows = [slot for slot, k in zip(slots, num_drafts) for _ in range(k + 1)]
        if not step.num_drafts:  # (a step without drafts samples as plain decoding does)
            sampled, emitted = sampler(logits, rows, grammar), [1] * len(slots)
        else:
            held = sampler.hold_draws([slot for slot, k in zip(slots, num_drafts) if k])
            drafts = [batch.token_ids[slot, batch.num_tokens[slot]: batch.num_tokens[slot] + k].tolist()
                      for slot, k in zip(slots, num_drafts)]
            ahead = [tokens[:i] for tokens in drafts for i in range(len(tokens) + 1)]  # each row's drafts before it
            sampled = sampler(logits, rows, grammar, ahead)
            emitted = verify(torch.tensor(sampled.token_ids), num_drafts, drafts)
            sampler.keep_draws(held, dict(zip(slots, emitted)))
            keep = [row for start, count in zip(_starts(num_drafts), emitted) for row in range(start, start + count)]
            sampled.token_ids = [sampled.token_ids[row] for row in keep]
            sampled.logprobs = [sampled.logprobs[row] for row in keep]
        sampled.num_emitted = emitted
        tokens, at = sampled.token_ids, 0
        writes = []
        for slot, count in zip(slots, emitted):
            writes.append((slot, batch.num_tokens[slot], tokens[at: at + count]))
            at += count
        batch.write_tokens(writes)
        return sampled

    def admit(self, plan: StepPlan) -> None:
        """The plan's new requests enter the proposer's books."""
        for new in plan.new_requests:
            self.proposer.reset(new.slot)

    def propose(self, plan: StepPlan, step: StepInputs, batch: InputBatch, emitted: list[int]) -> list[list[int]]:
        """Drafts for each request that sampled in the step (empty where the plan asked for none)."""
        asked = {batch.slots[rid]: k for rid, k in plan.propose.items()}
        picked = [(i, slot) for i, slot in enumerate(step.sampling_slots) if slot in asked]
        drafts: list[list[int]] = [[] for _ in step.sampling_slots]
        if picked:
            slots = [slot for _, slot in picked]
            proposed = self.proposer.propose(batch, slots, [batch.num_tokens[slot] + emitted[i] for i, slot in picked],
                                             [asked[slot] for slot in slots])
            for (i, _), tokens in zip(picked, proposed):
                drafts[i] = tokens
        return drafts


def _starts(num_drafts: list[int]) -> list[int]:
    """Each request's first row among the sampled rows (1 + k rows each)."""
    return list(itertools.accumulate((k + 1 for k in num_drafts[:-1]), initial=0))[: len(num_drafts)]
