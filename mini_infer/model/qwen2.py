"""The Qwen2 decoder-only network (Qwen2.5 family): fused QKV with bias, GQA over the paged KV cache,
SwiGLU MLP with fused gate/up, RMSNorm, tied or untied LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from mini_infer.config import ModelConfig
from mini_infer.model.attention import AttentionMetadata, write_kv
from mini_infer.model.ops import Ops
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, empty_parameter


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = empty_parameter(q_size + 2 * kv_size, config.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = empty_parameter(q_size + 2 * kv_size, dtype=dtype, device=device)
        self.o_proj = empty_parameter(config.hidden_size, q_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.ops.linear(x, self.qkv_proj, self.qkv_bias).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        with record_function("kv_write"):
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        with record_function("attention"):
            out = self.ops.attention(q, k_cache, v_cache, meta)
        return self.ops.linear(out.reshape(num_tokens, -1), self.o_proj)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Qwen2Attention(config, ops, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, ops.linear, **factory)

    def forward(self, x, positions, rotary, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device, max_positions: int,
                 ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        factory = dict(dtype=dtype, device=device)
        self.embed_tokens = empty_parameter(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, ops, **factory) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, **factory)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else empty_parameter(config.vocab_size, config.hidden_size, **factory))

    def linear_weights(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every matmul weight: the projections of each layer and the LM head."""
        pairs: list[tuple[nn.Module, str]] = []
        for layer in self.layers:
            pairs += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                      (layer.mlp, "down_proj")]
        return pairs + [(self, "lm_head")]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens -> logits [len(logits_indices), vocab] for the sampled rows only."""
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        with record_function("lm_head"):
            return self.ops.linear(self.norm(x[logits_indices]), self.lm_head)
