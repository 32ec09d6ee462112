"""Pooler: a pooling model's output for each request whose prompt a step finishes, on rank 0 (where the sampler is
for a generating model), vectorised over the step's requests.

Embeddings (task embed) read the final norm's hidden states: at each prompt's last token ("last" pooling), or their
mean over every prompt token ("mean" pooling: each step's rows are summed into their request's slot as its chunks
are computed, so a prompt chunked over several steps averages every token once; such requests compute their whole
prompt, never a cached prefix, and a request re-entering the batch starts its sum again). An embedding is cut to
its request's `dimensions` then L2-normalised where its request normalizes. A reranker's score (task score) is
sigmoid(logit(yes) - logit(no)) of the LM head's logits at the last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_infer.config import PoolerConfig
from mini_infer.pooling_params import PoolingParams
from mini_infer.runner.input_batch import StepInputs
from mini_infer.runner.plan import NewRequest


@dataclass(slots=True)
class PoolerOutput:
    """Each finishing request's embedding (a list of floats) or score (a float), in the order of the plan's requests
    that finish their prompt (as SamplerOutput's sampled rows are)."""

    values: list


class Pooler:
    def __init__(self, task: str, config: PoolerConfig, hidden_size: int, max_num_seqs: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.task, self.config, self.hidden_size = task, config, hidden_size
        self.dtype = torch.promote_types(dtype, torch.float32)  # what pooled values are computed in
        self.mean = task == "embed" and config.pooling_type == "mean"
        self._params: list[PoolingParams | None] = [None] * max_num_seqs
        self._num_prompt = torch.zeros(max_num_seqs, dtype=self.dtype, device=device)
        # Mean pooling: each slot's sum of its prompt's hidden states so far.
        self._sums = torch.zeros(max_num_seqs, hidden_size, dtype=self.dtype, device=device) if self.mean else None

    def add(self, request: NewRequest) -> None:
        """A request entering the batch (first admitted, or again after preemption: its prompt is computed anew)."""
        self._params[request.slot] = request.params
        self._num_prompt[request.slot] = request.num_prompt_tokens
        if self.mean:
            self._sums[request.slot] = 0

    def __call__(self, out: torch.Tensor, inputs: StepInputs) -> PoolerOutput | None:
        """The step's values from the runner's output: the final norm's hidden states (embed: the finishing rows, or
        with mean pooling every row of the step) or logits (score: the finishing rows); None if no prompt finishes."""
        finishing = inputs.sampling_slots
        if self.mean:
            query_lens = torch.diff(torch.tensor(inputs.query_start_loc))
            token_slots = torch.repeat_interleave(torch.tensor(inputs.slots), query_lens).to(self._sums.device)
            self._sums.index_add_(0, token_slots, out.to(self.dtype))
        if not finishing:
            return None
        if self.task == "score":
            no, yes = self.config.classifier_token_ids
            logits = out.to(self.dtype)
            return PoolerOutput(torch.sigmoid(logits[:, yes] - logits[:, no]).tolist())
        slots = torch.tensor(finishing, device=self._num_prompt.device)
        rows = self._sums[slots] / self._num_prompt[slots, None] if self.mean else out.to(self.dtype)
        return PoolerOutput(self._embeddings(rows, finishing))

    def _embeddings(self, rows: torch.Tensor, slots: list[int]) -> list[list[float]]:
        """Each row cut to its request's dimensions (the columns past them zeroed, so that they leave the norm
        alone), L2-normalised where its request normalizes, as lists of floats."""
        params = [self._params[slot] for slot in slots]
        dims = [p.dimensions or self.hidden_size for p in params]
        kept = torch.arange(self.hidden_size, device=rows.device) < torch.tensor(dims, device=rows.device)[:, None]
        rows = rows * kept
        normalize = torch.tensor([p.normalize for p in params], device=rows.device)
        rows = torch.where(normalize[:, None], F.normalize(rows, dim=-1), rows)
        return [row[:d] for row, d in zip(rows.tolist(), dims)]
