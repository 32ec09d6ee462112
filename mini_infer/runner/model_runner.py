"""ModelRunner: owns the model and the K/V tensors; turns a SchedulerOutput into flat input tensors,
runs the forward and samples.

Inputs are built with tensor ops from per-request scalars (O(batch) host work): positions continue each
request's own absolute positions, and slot mappings come from the block-table rows of the KV manager.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch.profiler import record_function

from mini_infer.config import EngineConfig
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.scheduler import SchedulerOutput
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.ops import select_ops
from mini_infer.model.loader import load_model
from mini_infer.runner.sampler import Sampler, SamplerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.kv_manager = kv_cache
        mc = config.model_config
        self.ops = select_ops(config.cpu_kernels, config.torch_dtype, config.device)
        self.model = load_model(mc, Path(config.model), dtype=config.torch_dtype, device=config.device,
                                max_positions=config.max_model_len, ops=self.ops)
        shape = (kv_cache.num_blocks, kv_cache.block_size, mc.num_key_value_heads, mc.head_dim)
        # Uninitialised: pages are committed as blocks are first written (zeroing gigabytes up front took
        # seconds here); attention never lets an unwritten slot reach its result.
        self.kv_caches = [
            (torch.empty(shape, dtype=config.torch_dtype, device=self.device),
             torch.empty(shape, dtype=config.torch_dtype, device=self.device))
            for _ in range(mc.num_hidden_layers)
        ]
        self.sampler = Sampler(mc.vocab_size, self.device, config.seed)

    def prepare_inputs(self, scheduled: SchedulerOutput):
        requests = scheduled.requests
        query_lens = torch.tensor(scheduled.num_new_tokens)
        start_positions = torch.tensor([r.num_computed_tokens for r in requests])
        rows = torch.tensor([self.kv_manager.row(r.request_id) for r in requests])
        if scheduled.is_prefill:
            new_tokens = (r.all_token_ids[r.num_computed_tokens:] for r in requests)
            input_ids = torch.tensor(list(chain.from_iterable(new_tokens)))
        else:
            input_ids = torch.tensor([r.last_token_id for r in requests])
        query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int64)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        request_of_token = torch.repeat_interleave(torch.arange(len(requests)), query_lens)
        positions = start_positions[request_of_token] + torch.arange(len(input_ids)) - query_start_loc[request_of_token]
        context_lens = start_positions + query_lens
        block_size = self.kv_manager.block_size
        max_blocks = int((context_lens.max() + block_size - 1) // block_size)
        block_tables = self.kv_manager.block_tables[rows, :max_blocks]
        slot_mapping = (block_tables[request_of_token, positions // block_size] * block_size
                        + positions % block_size)
        to = dict(device=self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(**to),
            block_tables=block_tables.to(**to),
            context_lens=context_lens.to(**to),
            query_start_loc=query_start_loc.tolist(),
            context_lens_host=context_lens.tolist(),
            max_query_len=int(query_lens.max()),
        )
        logits_indices = query_start_loc[1:] - 1
        return input_ids.to(**to), positions.to(**to), meta, logits_indices.to(**to)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> SamplerOutput:
        with record_function("input_prep"):
            input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
        with record_function("forward"):
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        with record_function("sampling"):
            return self.sampler(logits, scheduled.requests)
