"""Step inputs and the ModelRunner.

Rank 0 (the engine) turns a SchedulerOutput into StepInputs: flat tensors built with tensor ops from
per-request scalars (O(batch) host work); positions continue each request's own absolute positions, and slot
mappings come from the block-table rows of the KV manager. Every rank's ModelRunner (its shard of the model and
its K/V tensors) then runs the step: a pipeline stage after the first takes its input from the previous stage,
and rank 0 ends up with the logits of each request's last position.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from mini_infer.config import EngineConfig
from mini_infer.distributed.comm import Comm
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.scheduler import SchedulerOutput
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.loader import load_model
from mini_infer.model.ops import select_ops


@dataclass(slots=True)
class StepInputs:
    """One step's batch description: what rank 0 sends every other rank (CPU tensors, small)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_reqs, max_blocks]
    context_lens: torch.Tensor  # [num_reqs]
    logits_indices: torch.Tensor  # [num_reqs] the last new token of each request
    query_start_loc: list[int]
    context_lens_host: list[int]
    num_decodes: int  # the leading requests with one new token each (attention runs them as one batch)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prepare_inputs(scheduled: SchedulerOutput, kv_manager: KVCacheManager) -> StepInputs:
    requests = scheduled.requests
    query_lens = torch.tensor(scheduled.num_new_tokens)
    start_positions = torch.tensor([r.num_computed_tokens for r in requests])
    rows = torch.tensor([kv_manager.row(r.request_id) for r in requests])
    if scheduled.is_prefill:
        new_tokens = (r.token_ids_slice(r.num_computed_tokens, r.num_computed_tokens + n)
                      for r, n in zip(requests, scheduled.num_new_tokens))
        input_ids = torch.tensor(list(chain.from_iterable(new_tokens)))
    else:
        input_ids = torch.tensor([r.last_token_id for r in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    request_of_token = torch.repeat_interleave(torch.arange(len(requests)), query_lens)
    positions = start_positions[request_of_token] + torch.arange(len(input_ids)) - query_start_loc[request_of_token]
    context_lens = start_positions + query_lens
    block_size = kv_manager.block_size
    max_blocks = int((context_lens.max() + block_size - 1) // block_size)
    block_tables = kv_manager.block_tables[rows, :max_blocks]
    slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size
    multi = (query_lens > 1).nonzero()
    return StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
                      context_lens=context_lens,
                      logits_indices=(query_start_loc[1:] - 1)[torch.tensor(scheduled.samples, dtype=torch.bool)],
                      query_start_loc=query_start_loc.tolist(), context_lens_host=context_lens.tolist(),
                      num_decodes=int(multi[0, 0]) if len(multi) else len(requests))


class ModelRunner:
    """One rank's shard of the model and the K/V tensors of its layers (its share of the KV heads)."""

    def __init__(self, config: EngineConfig, num_blocks: int, comm: Comm, device: torch.device) -> None:
        self.config, self.comm, self.device = config, comm, device
        mc, shard = config.model_config, comm.shard
        self.ops = select_ops(config.cpu_kernels, config.torch_dtype, device)
        self.model = load_model(mc, Path(config.model), dtype=config.torch_dtype, device=device,
                                max_positions=config.max_model_len, ops=self.ops, comm=comm)
        shape = (num_blocks, config.block_size, shard.num_kv_heads, mc.head_dim)
        # Uninitialised: pages are committed as blocks are first written (zeroing gigabytes up front took
        # seconds here); attention never lets an unwritten slot reach its result.
        self.kv_caches = [
            (torch.empty(shape, dtype=config.torch_dtype, device=device),
             torch.empty(shape, dtype=config.torch_dtype, device=device))
            for _ in range(shard.num_layers)
        ]

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """Run this rank's part of the step; rank 0 gets the logits [num_reqs, >= vocab], the others None."""
        to = dict(device=self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping.to(**to), block_tables=step.block_tables.to(**to),
            context_lens=step.context_lens.to(**to), query_start_loc=step.query_start_loc,
            context_lens_host=step.context_lens_host, num_decodes=step.num_decodes)
        comm, shard = self.comm, self.comm.shard
        if shard.first_stage:
            inputs = step.input_ids.to(**to)
        else:
            inputs = comm.recv_hidden(step.num_tokens, self.config.model_config.hidden_size,
                                      self.config.torch_dtype, self.device)
        out = self.model(inputs, step.positions.to(**to), self.kv_caches, meta, step.logits_indices.to(**to))
        if not shard.last_stage:
            comm.send_hidden(out)
            out = None
        if comm.rank == comm.logits_source and comm.rank != 0:
            comm.send_logits(out)
        elif comm.rank == 0 and comm.logits_source != 0:
            out = comm.recv_logits(len(step.logits_indices), self.config.torch_dtype, self.device)
        return out if comm.rank == 0 else None

    def memory_stats(self) -> dict:
        """This rank's parameter and KV bytes, and its peak memory (CUDA max allocated, or the process's peak
        resident set on the CPU)."""
        params = sum(t.numel() * t.element_size() for t in _unique_tensors(self.model))
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)
        stats = {"rank": self.comm.rank, "tp_all_reduce": self.comm.tp_all_reduce, "param_bytes": params,
                 "kv_bytes": kv, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            stats["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return stats


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every weight the model holds once: its parameters and the packed weights that replaced some of them
    (a tied head's packed copy is its own tensor)."""
    seen, tensors = set(), []
    for module in model.modules():
        for value in (*module._parameters.values(), *vars(module).values()):
            tensor = getattr(value, "data", value)
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                tensors.append(tensor)
    return tensors
