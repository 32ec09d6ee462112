"""Shard: what one rank holds of the model, from its tensor-parallel and pipeline-parallel coordinates.

Tensor parallel (Megatron-style) splits query heads, KV heads (replicated when the ranks outnumber them), the
MLP's intermediate dimension and the vocabulary; pipeline parallel gives each stage a contiguous range of layers,
the first stage the embedding and the last the final norm and LM head. A single process is the shard (1, 0, 1, 0).
Pure arithmetic: no process group is needed to compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mini_infer.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Shard:
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    num_heads: int  # query heads on this rank
    head_start: int  # first of them, as a global head index
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int  # this rank's slice of the MLP
    intermediate_start: int
    vocab_shard_size: int  # rows of this rank's embedding / LM head slice (the last slice is zero-padded)
    vocab_start: int
    vocab_end: int  # real (unpadded) rows end here
    layer_start: int  # this stage's layers: [layer_start, layer_end)
    layer_end: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def intermediate_slice(self, size: int) -> slice:
        """This rank's slice of an MLP's intermediate dimension of `size` (a mixture's experts and shared expert are
        split as the dense MLP is: EngineConfig checked that tp divides each)."""
        per_rank = size // self.tp_size
        return slice(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)


def make_shard(config: ModelConfig, tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0) -> Shard:
    """The shard of rank (tp_rank, pp_rank); EngineConfig has already checked that the sizes split the model."""
    heads = config.num_attention_heads // tp_size
    if config.num_key_value_heads >= tp_size:
        kv_heads = config.num_key_value_heads // tp_size
        kv_start = tp_rank * kv_heads
    else:  # replicated: tp_size / kv_heads consecutive ranks share one KV head
        kv_heads, kv_start = 1, tp_rank // (tp_size // config.num_key_value_heads)
    inter = config.intermediate_size // tp_size
    vocab_shard = -(-config.vocab_size // tp_size)
    vocab_start = min(tp_rank * vocab_shard, config.vocab_size)
    layers = config.num_hidden_layers
    return Shard(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank,
                 num_heads=heads, head_start=tp_rank * heads, num_kv_heads=kv_heads, kv_head_start=kv_start,
                 intermediate_size=inter, intermediate_start=tp_rank * inter,
                 vocab_shard_size=vocab_shard, vocab_start=vocab_start,
                 vocab_end=min(vocab_start + vocab_shard, config.vocab_size),
                 layer_start=pp_rank * layers // pp_size, layer_end=(pp_rank + 1) * layers // pp_size)
