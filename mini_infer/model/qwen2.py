"""The decoder-only network of Qwen2 (Qwen2.5), Qwen3 and Llama (3, 3.1, 3.2), and of Qwen2-MoE and Qwen3-MoE: fused
QKV (with a bias where the config has one: Qwen2's; the others' are zero), Qwen3's RMSNorm on each head of q and k,
GQA over the paged KV cache, SwiGLU MLP with fused gate/up (in a MoE's sparse layers a mixture of such experts:
model/moe.py), RMSNorm, RoPE (plain or Llama 3.1's scaled frequencies), tied or untied LM head.
One class serves them all (config.SUPPORTED_ARCHITECTURES): they differ only in those switches.

Built for one Shard (mini_infer.distributed.shard): a single process holds the whole network; a tensor-parallel
rank holds column slices of QKV and gate/up, row slices of o_proj and down_proj (their partial sums meet in
Comm.all_reduce) and a vocabulary slice of the embedding and LM head; a pipeline stage holds its layers only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import ModelConfig
from mini_infer.distributed.comm import Comm
from mini_infer.distributed.shard import Shard
from mini_infer.kernels.autotune import bucket_index
from mini_infer.kernels.decoder import DecoderStack, LayerTensors
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, empty_parameter
from mini_infer.model.moe import SparseMoeBlock, swiglu_mlps
from mini_infer.model.ops import Ops
from mini_infer.profiling import profiled


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, comm: Comm, ops: Ops, *, dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.ops, self.comm = ops, comm
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = empty_parameter(q_size + 2 * kv_size, config.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = empty_parameter(q_size + 2 * kv_size, dtype=dtype, device=device)
        self.o_proj = empty_parameter(config.hidden_size, q_size, dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj, self.qkv_bias)
        q = self.ops.rope_kv_write(qkv, positions, rotary, kv_cache, meta.slot_mapping, self.num_heads, self.q_norm,
                                   self.k_norm)
        with profiled("attention"):
            out = self.ops.attention(q, *kv_cache, meta)
        return self.comm.all_reduce(self.ops.linear(out.reshape(num_tokens, -1), self.o_proj))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, comm: Comm, ops: Ops, index: int, *, dtype: torch.dtype,
                 device) -> None:
        """index: the layer's place in the whole model (a sparse layer's MLP is a mixture of experts)."""
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Qwen2Attention(config, shard, comm, ops, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        if config.sparse(index):
            moe = config.moe
            sizes = (moe.intermediate_size, moe.shared_expert_intermediate_size)
            experts, shared = (size // shard.tp_size for size in sizes)
            self.mlp = SparseMoeBlock(moe, config.hidden_size, experts, shared, ops.linear, comm.all_reduce,
                                      ops.silu_and_mul, ops.route_experts, ops.experts_sum, ops.grouped_linear,
                                      **factory)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, shard.intermediate_size, ops.linear, comm.all_reduce,
                                 ops.silu_and_mul, **factory)
        self.ops = ops

    def forward(self, x, residual, positions, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it), the vLLM way: each norm adds
        the block output before it to the stream (the first layer's input norm has none), which rounds as
        `residual + block(norm(residual))` does."""
        h, residual = self.ops.rms_norm(self.input_layernorm, x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.ops.rms_norm(self.post_attention_layernorm, h, residual)
        return self.mlp(h), residual


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device, max_positions: int, ops: Ops,
                 shard: Shard, comm: Comm, lm_head: bool = True) -> None:
        """lm_head False: the layers and the final norm only (an embedding model's: it pools hidden states)."""
        super().__init__()
        self.config, self.shard, self.comm, self.ops = config, shard, comm, ops
        self.has_lm_head = lm_head
        factory = dict(dtype=dtype, device=device)
        vocab_rows = (shard.vocab_shard_size, config.hidden_size)
        self.embed_tokens = empty_parameter(*vocab_rows, **factory) if shard.first_stage else None
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, shard, comm, ops, index, **factory)
                                    for index in range(shard.layer_start, shard.layer_end))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, **factory,
                                      scaling=config.rope_scaling, freq_factors=config.rope_freq_factors)
        self.norm = self.lm_head = None
        if shard.last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
            tied_here = config.tie_word_embeddings and shard.first_stage
            if lm_head:
                self.lm_head = self.embed_tokens if tied_here else empty_parameter(*vocab_rows, **factory)
        self._stacks: dict[tuple, DecoderStack | None] = {}  # per batch-size bucket, built on first use

    def linear_weights(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every matmul weight: the projections of each layer (a mixture's router among them,
        which Ops never quantises) and the LM head."""
        pairs: list[tuple[nn.Module, str]] = []
        for layer in self.layers:
            pairs += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
            if isinstance(layer.mlp, SparseMoeBlock):
                pairs.append((layer.mlp, "gate"))
            pairs += [(mlp, name) for mlp in swiglu_mlps(layer.mlp) for name in ("gate_up_proj", "down_proj")]
        return pairs + ([(self, "lm_head")] if self.lm_head is not None else [])

    def _decoder_stack(self, num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata) -> DecoderStack | None:
        """All the layers in one native call (kernels/decoder.py) for a step where every request decodes one token
        (or every token has a row of its own: meta.token_rows) and every matmul of that batch size runs natively;
        None where the layers run one op at a time (prefill, torch's matmul, tensor parallel: there the projections'
        partial sums meet between the kernels; a mixture of experts)."""
        rows = meta.token_rows[1].shape[0] if meta.token_rows is not None else meta.num_reqs
        if (not self.ops.runs("decode_layers") or not self.layers or self.shard.tp_size > 1
                or self.config.moe is not None
                or (meta.token_rows is None and meta.num_decodes != meta.num_reqs) or num_tokens != rows):
            return None
        # The matmul choices are the autotuner's per batch-size bucket (a GGUF file's layers differ in their weights'
        # formats, so in their choices); the caches are the runner's, fixed.
        key = (bucket_index(num_tokens), kv_caches[0][0].data_ptr())
        if key not in self._stacks:
            matmuls = [[self._qkv_linear(layer.self_attn.qkv_proj, num_tokens), *(
                self.ops.native_linear(weight, num_tokens)  # (None for a fused weight of parts: op by op)
                for weight in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))]
                for layer in self.layers]
            self._stacks[key] = None if any(None in chosen for chosen in matmuls) else DecoderStack(
                [LayerTensors(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                              layer.self_attn.qkv_bias, *kv_cache, *chosen,
                              *(norm.weight if norm is not None else None for norm in (
                                  layer.self_attn.q_norm, layer.self_attn.k_norm)))
                 for layer, kv_cache, chosen in zip(self.layers, kv_caches, matmuls)],
                num_heads=self.shard.num_heads, intermediate_size=self.shard.intermediate_size,
                eps=self.config.rms_norm_eps, cos=self.rotary.cos, sin=self.rotary.sin)
        return self._stacks[key]

    def _qkv_linear(self, weight, rows: int):
        """The native path and packed weight of the QKV matmul of `rows` rows (Ops.native_linear), or for a fused
        weight of differently quantised parts each part's; None where torch's matmul runs it (or one of its parts)."""
        if isinstance(weight, tuple):
            parts = tuple(self.ops.native_linear(part, rows) for part in weight)
            return None if None in parts else parts
        return self.ops.native_linear(weight, rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: each rank looks up the ids in its slice, zeros the others; the sum has every row.
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_end - self.shard.vocab_start)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor, logits_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Flat batch of new tokens (their ids on the first stage, the previous stage's hidden states [T, hidden]
        on the others) -> this stage's hidden states, or on the last stage the logits of the sampled rows only:
        [len(logits_indices), tp * vocab_shard_size] on its tensor rank 0, None on its other tensor ranks (the LM
        head writes this rank's shard into `logits_out` where given: compute_logits)."""
        x, residual = self.hidden_states(inputs, positions, kv_caches, meta)
        if not self.shard.last_stage:
            return x if residual is None else x + residual
        return self.compute_logits(x, residual, logits_indices, logits_out)

    def hidden_states(self, inputs: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers of this stage: (the last layer's MLP output, the residual stream before it; None for a stage
        without layers), as each layer's forward gives them."""
        x = self.embed(inputs) if self.shard.first_stage else inputs
        residual = None
        stack = self._decoder_stack(x.shape[0], kv_caches, meta)
        if stack is not None:  # (with token rows: every token a row of its own, as a decode step's)
            block_tables, context_lens = meta.token_rows or (meta.block_tables, meta.context_lens)
            with profiled("decoder_layers"):
                return stack(x, positions, meta.slot_mapping, block_tables, context_lens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        return x, residual

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """The final norm's output at rows `rows` of the last stage's layer outputs (it adds the last MLP output to
        the residual stream): what the LM head reads, and what an embedding model pools."""
        x, _ = self.ops.rms_norm(self.norm, x[rows], residual[rows] if residual is not None else None)
        return x

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor | None, logits_indices: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last stage's logits of the rows `logits_indices` of the layers' outputs (this rank's vocabulary shard
        written into `out` [rows, vocab_shard_size] where given)."""
        with profiled("lm_head"):
            return self.comm.gather_vocab(self.ops.linear(self.final_hidden(x, residual, logits_indices),
                                                          self.lm_head, out=out))
