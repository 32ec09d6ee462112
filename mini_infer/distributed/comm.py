"""Comm: one rank's communication: the tensor-parallel collectives the model calls and the pipeline hand-offs
the runner makes. A single process gets Comm.local(): every collective is the identity there.

Global ranks are laid out stage-major, rank = pp_rank * tp_size + tp_rank, so rank 0 (the engine, which also
schedules and samples) is tensor rank 0 of the first stage. Collectives run on the device group (gloo on the
CPU, NCCL on CUDA), except the tensor-parallel all-reduce of CPU ranks on one machine, which goes through shared
memory (mini_infer.distributed.shm: gloo's ~2 ms per all-reduce here would be half a decode step); the step
descriptions rank 0 broadcasts go over a gloo group (`control`) either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mini_infer.config import EngineConfig
from mini_infer.distributed.shard import Shard, make_shard
from mini_infer.distributed.shm import ShmAllReduce, shm_unavailable_reason


@dataclass(slots=True)
class Comm:
    shard: Shard
    rank: int = 0
    tp_group: object | None = None  # this stage's tensor-parallel group
    control: object | None = None  # gloo group of every rank: step descriptions from rank 0
    shm_all_reduce: Callable | None = None  # the stage's shared-memory all-reduce, when its ranks share a machine
    tp_all_reduce: str = "none (one rank)"  # which all-reduce runs, and why

    @classmethod
    def local(cls, config: EngineConfig) -> Comm:
        return cls(make_shard(config.model_config))

    # ---- tensor parallel (called by the model) ----

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial results of a row-parallel layer (or the vocab-parallel embedding) over the stage."""
        if self.shm_all_reduce is not None:
            return self.shm_all_reduce(x)
        if self.shard.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[R, vocab_shard] slices of the vocab-parallel LM head -> [R, tp * vocab_shard] on the stage's tensor
        rank 0 (None on the others)."""
        if self.shard.tp_size == 1:
            return logits
        logits = logits.contiguous()
        leader = self.rank - self.shard.tp_rank
        parts = [torch.empty_like(logits) for _ in range(self.shard.tp_size)] if self.shard.tp_rank == 0 else None
        dist.gather(logits, parts, dst=leader, group=self.tp_group)
        return torch.cat(parts, dim=1) if parts is not None else None

    # ---- pipeline parallel (called by the runner) ----

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> torch.Tensor:
        x = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(x, src=self.rank - self.shard.tp_size)
        return x

    def send_hidden(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.rank + self.shard.tp_size)

    def send_logits(self, logits: torch.Tensor) -> None:
        dist.send(logits.contiguous(), dst=0)

    def recv_logits(self, num_reqs: int, dtype: torch.dtype, device) -> torch.Tensor:
        logits = torch.empty(num_reqs, self.shard.tp_size * self.shard.vocab_shard_size, dtype=dtype, device=device)
        dist.recv(logits, src=self.logits_source)
        return logits

    @property
    def logits_source(self) -> int:
        """The rank whose forward ends with the full logits: tensor rank 0 of the last stage."""
        return (self.shard.pp_size - 1) * self.shard.tp_size


def init_process_groups(config: EngineConfig, rank: int, world_size: int, init_method: str, device: torch.device,
                        timeout_s: float) -> Comm:
    """Join the world (every rank calls this with the same config) and build this rank's groups."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed world; one tensor/pipeline-"
                           "parallel engine per process (use data_parallel_size for more replicas)")
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if world_size != tp * pp:
        raise ValueError(f"WORLD_SIZE={world_size} but tensor_parallel_size * pipeline_parallel_size = {tp * pp}")
    backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    tp_group = None
    for stage in range(pp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
        if stage == rank // tp:
            tp_group = group
    shard = make_shard(config.model_config, tp, rank % tp, pp, rank // tp)
    comm = Comm(shard, rank=rank, tp_group=tp_group, control=control)
    if tp > 1:
        reason = shm_unavailable_reason(tp_group, device)
        if reason is None:
            comm.shm_all_reduce = ShmAllReduce(tp_group, shard.tp_rank, tp, leader=rank - shard.tp_rank,
                                               timeout_s=timeout_s)
            comm.tp_all_reduce = "shared memory"
        else:
            comm.tp_all_reduce = f"{backend} ({reason})"
    return comm
