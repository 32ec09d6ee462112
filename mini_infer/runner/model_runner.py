"""ModelRunner: one rank's shard of the model, its K/V tensors and its persistent input batch.

Every rank applies the same StepPlan to its own InputBatch and runs its part of the step: a pipeline stage
after the first takes its input from the previous stage, and rank 0 ends up with the logits of the requests
that sample, which its Sampler turns into tokens. A pooling model's rank 0 (task embed or score, one stage) has a
Pooler instead: it turns the final norm's hidden states (embed) or the logits (score) of the requests whose
prompt the step finishes into their embeddings or scores.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mini_infer.config import EngineConfig
from mini_infer.distributed.comm import Comm
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.loader import load_model
from mini_infer.model.ops import TunedWeight, select_backend
from mini_infer.profiling import profiled
from mini_infer.runner.graphs import CaptureReport, DecodeGraphs
from mini_infer.runner.input_batch import InputBatch, StepInputs
from mini_infer.runner.metadata import attention_metadata
from mini_infer.runner.plan import PLACEHOLDER, StepPlan
from mini_infer.runner.pooler import Pooler, PoolerOutput
from mini_infer.runner.sampler import Sampler, SamplerOutput, prompt_logprobs
from mini_infer.runner.spec_decode import Speculator


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device: its output, whose sampled token ids (when `tokens` is set) are still
    on their way to the host (ModelRunner.collect waits for them)."""

    output: SamplerOutput | PoolerOutput | None
    tokens: torch.Tensor | None = None  # the sampled ids, in host memory once `copied` has completed
    copied: torch.cuda.Event | None = None  # (CUDA) the copy of `tokens` to the host


class ModelRunner:
    """One rank's shard of the model, the K/V tensors of its layers (its share of the KV heads) and its batch;
    rank 0 also samples (or pools)."""

    def __init__(self, config: EngineConfig, num_blocks: int, comm: Comm, device: torch.device) -> None:
        self.config, self.comm, self.device = config, comm, device
        mc, shard = config.model_config, comm.shard
        self.ops = select_backend(config, device)
        self.embeds = config.task == "embed"  # pools the final norm's hidden states: no LM head
        self.model = load_model(mc, Path(config.model), dtype=config.torch_dtype, device=device,
                                max_positions=config.max_model_len, ops=self.ops, comm=comm, lm_head=not self.embeds)
        shape = (num_blocks, config.block_size, shard.num_kv_heads, mc.head_dim)
        # Uninitialised: pages are committed as blocks are first written (zeroing gigabytes up front took
        # seconds here); attention never lets an unwritten slot reach its result.
        self.kv_caches = [
            (torch.empty(shape, dtype=config.torch_dtype, device=device),
             torch.empty(shape, dtype=config.torch_dtype, device=device))
            for _ in range(shard.num_layers)
        ]
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.max_blocks_per_seq,
                                      config.block_size)
        self.sampler = Sampler(mc.vocab_size, device, config.seed, self.ops.argmax, self.ops.top_k,
                               self.ops.mask_rows, invariant=config.deterministic) \
            if comm.rank == 0 and config.pooler is None else None
        self.pooler = Pooler(config.task, config.pooler, mc.hidden_size, config.max_num_seqs, config.torch_dtype,
                             device) if comm.rank == 0 and config.pooler is not None else None
        # Speculative decoding: rank 0 verifies drafts and proposes the next (runner/spec_decode.py)
        self.speculator = Speculator(config, num_blocks, device) \
            if self.sampler is not None and config.speculative_config is not None else None
        # On the CPU the LM head writes into one reused buffer: a fresh [rows, vocab] tensor past glibc's mmap
        # threshold (32 MB: 56 float32 rows of a 151,936-token vocabulary) is mapped, faulted in page by page and
        # unmapped every step (~55 ms of a batch-256 step on a Zen 3). Up to a decode step of every sequence with
        # its drafts; larger (prompt logprobs over long chunks) allocate as before.
        spec = config.speculative_config
        self._logits_rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        self._logits: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_report: CaptureReport | None = None
        # Graphs hold the GPU backend's decode steps on one rank (across ranks they would hold the collectives too);
        # a mixture of experts reads its routing on the host every layer (model/moe.py), so its steps run eagerly.
        if self.ops.graph_safe and not config.enforce_eager and config.world_size == 1 and mc.moe is None:
            self.graphs = DecodeGraphs(self._decode_layers, config.max_num_seqs, config.max_blocks_per_seq, device)
            self.graph_report = self.graphs.capture()
        # Async scheduling (EngineConfig.async_scheduling): a step may be planned before the one before it has sampled,
        # its decode rows' input ids then PLACEHOLDER, replaced on the device by the tokens of the last sampling step
        # (held here with each slot's row in them). The ids reach the host through two pinned buffers in turn (the next
        # step's copy must not overwrite those the engine has yet to read).
        self.runs_ahead = self.sampler is not None and config.runs_ahead
        if self.runs_ahead:
            self._last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
            self._row_of_slot = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
        self._host_tokens = [torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=True)
                             for _ in range(2)] if device.type == "cuda" and self.sampler is not None else []

    def _decode_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's layers over tensors alone (what a graph captures): one token for each row."""
        rows = input_ids.shape[0]
        meta = AttentionMetadata(slot_mapping, block_tables, context_lens, query_start_loc=list(range(rows + 1)),
                                 context_lens_host=None, num_decodes=rows)
        return self.model.hidden_states(input_ids, positions, self.kv_caches, meta)

    def prepare(self, plan: StepPlan) -> StepInputs | None:
        """Apply the plan to the persistent batch (and the sampler's slots) and build the step's inputs (None
        when the plan only says who left)."""
        batch = self.input_batch
        if self.sampler is not None:
            for request_id in plan.finished_ids:
                self.sampler.release(request_id, batch.slots.get(request_id), finished=True)
            for request_id in plan.preempted_ids:
                self.sampler.release(request_id, batch.slots.get(request_id), finished=False)
        gained = batch.update(plan)
        if self.sampler is not None:
            for new in plan.new_requests:
                self.sampler.add(new)
            self.sampler.append(*gained)
        if self.speculator is not None:
            self.speculator.admit(plan)
        if self.pooler is not None:
            for new in plan.new_requests:
                self.pooler.add(new)
        return batch.prepare(plan) if plan.request_ids else None

    def execute(self, plan: StepPlan) -> SamplerOutput | PoolerOutput | None:
        """Run one step; rank 0 returns the sampled tokens of the requests that sample, or a pooling model's values
        of the requests whose prompt it finishes (None if there are none)."""
        return self.collect(self.launch(plan))

    def collect(self, launched: LaunchedStep | None) -> SamplerOutput | PoolerOutput | None:
        """A launched step's output, once its sampled token ids are on the host."""
        if launched is None:
            return None
        if launched.tokens is not None:
            if launched.copied is not None:
                launched.copied.synchronize()
            launched.output.token_ids = launched.tokens.tolist()
        return launched.output

    def launch(self, plan: StepPlan) -> LaunchedStep | None:
        """Queue one step's work; on a CUDA device the host goes on while it runs, up to the logprobs (or drafts) of
        requests that asked for them. collect() gives its output."""
        with profiled("input_prep"):
            inputs = self.prepare(plan)
        if inputs is None:
            return None
        with profiled("forward"):
            logits = self.forward(inputs)
        if self.pooler is not None:
            with profiled("pooling"):
                return LaunchedStep(self.pooler(logits, inputs))
        if self.sampler is None or not (inputs.sampling_slots or inputs.prompt_owners):
            return None
        num_sampled = len(inputs.sampling_slots) + sum(inputs.num_drafts)  # (a verifying request: 1 + k rows)
        launched = LaunchedStep(None)
        with profiled("sampling"):
            if not num_sampled:
                sampled = SamplerOutput([], [])
            elif self.speculator is not None:
                sampled = self.speculator.sample(self.sampler, logits[:num_sampled], inputs, self.input_batch,
                                                 plan.grammar)
            else:
                tokens, logprobs = self.sampler.sample(logits[:num_sampled], inputs.sampling_slots, plan.grammar)
                sampled = SamplerOutput([], logprobs)
                launched.tokens, launched.copied = self._tokens_to_host(tokens, inputs.sampling_slots)
            if inputs.prompt_owners:
                sampled.prompt_logprobs = prompt_logprobs(logits[num_sampled:], inputs.prompt_targets,
                                                          inputs.prompt_owners, self.sampler.vocab_size,
                                                          self.sampler.largest)
        if self.speculator is not None and plan.propose and num_sampled:
            with profiled("propose"):
                start = time.perf_counter()
                sampled.draft_token_ids = self.speculator.propose(plan, inputs, self.input_batch,
                                                                  sampled.num_emitted)
                sampled.draft_seconds = time.perf_counter() - start
        launched.output = sampled
        return launched

    def _tokens_to_host(self, tokens: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Keep a step's sampled ids for the next step's pending inputs (when steps run ahead), and start their copy
        to the host: on a CUDA device into the pinned buffer of this step's turn, behind an event."""
        if self.runs_ahead:
            self._last_tokens[: len(slots)] = tokens
            self._row_of_slot[torch.tensor(slots).to(self.device, non_blocking=True)] = torch.arange(
                len(slots), device=self.device)
        if not self._host_tokens:
            return tokens, None
        self._host_tokens.reverse()
        host = self._host_tokens[0][: len(slots)]
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied

    def _fill_pending(self, input_ids: torch.Tensor, step: StepInputs) -> None:
        """Replace, in place on the device, the PLACEHOLDER input ids of the step's decode rows (the leading ones) with
        the tokens their requests sampled in the step before, which the host has not seen yet."""
        if not self.runs_ahead or not step.num_decodes:
            return
        rows = input_ids[: step.num_decodes]
        slots = torch.tensor(step.slots[: step.num_decodes]).to(self.device, non_blocking=True)
        rows.copy_(torch.where(rows == PLACEHOLDER, self._last_tokens[self._row_of_slot[slots]], rows))

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """Run this rank's part of the step; rank 0 gets the logits [num_reqs, >= vocab] (an embedding model: the
        final norm's hidden states of the rows it pools), the others None."""
        to = dict(device=self.device, non_blocking=True)
        hidden = self.graphs.run(step, self._fill_pending) if self.graphs is not None else None
        if hidden is not None:
            return self._last_stage_output(*hidden, step)
        meta = attention_metadata(step.slot_mapping, step.block_tables, step.context_lens, step.positions,
                                  step.query_start_loc, step.context_lens_host, step.num_decodes, self.device,
                                  self.config.deterministic)
        comm, shard = self.comm, self.comm.shard
        if shard.first_stage:
            inputs = step.input_ids.to(**to)  # (the step's own tensor: a gather from the batch's rows)
            self._fill_pending(inputs, step)
        else:
            inputs = comm.recv_hidden(step.num_tokens, self.config.model_config.hidden_size,
                                      self.config.torch_dtype, self.device)
        if self.embeds:  # one stage (EngineConfig): this rank's layers end with the final norm
            hidden = self.model.hidden_states(inputs, step.positions.to(**to), self.kv_caches, meta)
            return self._last_stage_output(*hidden, step) if comm.rank == 0 else None
        out = self.model(inputs, step.positions.to(**to), self.kv_caches, meta, step.logits_indices.to(**to),
                         self._logits_buffer(len(step.logits_indices)))
        if not shard.last_stage:
            comm.send_hidden(out)
            out = None
        if comm.rank == comm.logits_source and comm.rank != 0:
            comm.send_logits(out)
        elif comm.rank == 0 and comm.logits_source != 0:
            out = comm.recv_logits(len(step.logits_indices), self.config.torch_dtype, self.device)
        return out if comm.rank == 0 else None

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """[rows, vocab shard] of the reused logits buffer on a CPU rank with the LM head (None elsewhere, or past
        its rows): its contents last until the next step's LM head, so nothing may keep the logits past a step."""
        if self.device.type != "cpu" or self.model.lm_head is None or not 0 < rows <= self._logits_rows:
            return None
        if self._logits is None or self._logits.shape[0] < rows:
            capacity = min(self._logits_rows, max(rows, 2 * (self._logits.shape[0] if self._logits is not None else 0)))
            self._logits = None  # (the old buffer goes before the new one is mapped)
            self._logits = torch.empty(capacity, self.comm.shard.vocab_shard_size, dtype=self.config.torch_dtype)
        return self._logits[:rows]

    def _last_stage_output(self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs) -> torch.Tensor:
        """From the last layer's outputs: the logits of the sampling rows, or an embedding model's final hidden states
        at the rows it pools (its prompts' last tokens, or with mean pooling every token of the step)."""
        rows = step.logits_indices
        if not self.embeds:
            return self.model.compute_logits(x, residual, rows.to(self.device, non_blocking=True))
        if self.config.pooler.pooling_type == "mean":
            rows = torch.arange(step.num_tokens)
        return self.model.final_hidden(x, residual, rows.to(self.device, non_blocking=True))

    def memory_stats(self) -> dict:
        """This rank's parameter and KV bytes, its peak memory (CUDA max allocated, or the process's peak resident
        set on the CPU), and the kernels it runs: the note of model/ops.py and the autotuner's matmul choices."""
        params = sum(t.numel() * t.element_size() for t in _unique_tensors(self.model))
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)
        stats = {"rank": self.comm.rank, "tp_all_reduce": self.comm.tp_all_reduce, "param_bytes": params,
                 "kv_bytes": kv, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "kernels": self.ops.note, "matmul_choices": self.ops.matmul_choices()}
        if self.device.type == "cuda":
            stats["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.graph_report is not None:
            stats["decode_graphs"] = {"sizes": self.graph_report.sizes, "capture_s": self.graph_report.seconds,
                                      "memory_bytes": self.graph_report.memory_bytes}
        return stats


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every weight the model holds once: its parameters and the packed (or autotuned) weights that replaced some
    of them (a tied head's packed copy is its own tensor)."""
    seen, tensors = set(), []
    for module in model.modules():
        for value in (*module._parameters.values(), *vars(module).values()):
            # (a tuple of tuned weights: a fused weight of differently quantised parts, Ops.prepare)
            parts = value if isinstance(value, tuple) and value and isinstance(value[0], TunedWeight) else (value,)
            for part in parts:
                for tensor in part.tensors() if isinstance(part, TunedWeight) else [getattr(part, "data", part)]:
                    if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                        seen.add(tensor.data_ptr())
                        tensors.append(tensor)
    return tensors

