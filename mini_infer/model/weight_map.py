"""Where each tensor of a checkpoint goes in our network, for the loaders of safetensors directories (loader.py) and
GGUF files (gguf_weights.py): every tensor's HF name with its shape, the fused parameters and the slices of them a
tensor- or pipeline-parallel rank holds, and a pre-quantised checkpoint's projections in the order they stack."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mini_infer.config import ModelConfig
from mini_infer.distributed.shard import Shard
from mini_infer.model import prequantized
from mini_infer.model.qwen2 import Qwen2ForCausalLM


@dataclass(frozen=True, slots=True)
class Target:
    """Copy checkpoint[rows, cols] into param[row_start : row_start + len(rows)]."""

    param: torch.nn.Parameter
    row_start: int
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))


def projections(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """Layer `layer`'s projections in the checkpoint (name without .weight -> [out_features, in_features])."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    p = f"model.layers.{layer}."
    return {f"{p}self_attn.q_proj": (q_size, hidden), f"{p}self_attn.k_proj": (kv_size, hidden),
            f"{p}self_attn.v_proj": (kv_size, hidden), f"{p}self_attn.o_proj": (hidden, q_size),
            f"{p}mlp.gate_proj": (inter, hidden), f"{p}mlp.up_proj": (inter, hidden),
            f"{p}mlp.down_proj": (hidden, inter)}


def expected_shapes(config: ModelConfig, lm_head: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole checkpoint with its shape (lm_head only when the model has one, untied); a
    pre-quantised checkpoint's projections as their packed tensors (prequantized.packed_shapes), g_idx optional
    without act-order."""
    hidden = config.hidden_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if lm_head and not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p, layer = f"model.layers.{i}.", projections(config, i)
        for name, (out_features, in_features) in layer.items():
            if config.quantization is None:
                shapes[f"{name}.weight"] = (out_features, in_features)
                continue
            packed = prequantized.packed_shapes(config.quantization, out_features, in_features)
            shapes.update({f"{name}.{suffix}": shape for suffix, (shape, _) in packed.items()})
        for name in ("q", "k", "v") if config.attention_bias else ():
            shapes[f"{p}self_attn.{name}_proj.bias"] = (layer[f"{p}self_attn.{name}_proj"][0],)
        shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def optional(name: str, config: ModelConfig) -> bool:
    """A tensor the checkpoint may leave out: GPTQ's g_idx without act-order (the inputs are then in group order)."""
    quant = config.quantization
    return quant is not None and quant.method == "gptq" and not quant.desc_act and name.endswith(".g_idx")


def quantized_linears(model: Qwen2ForCausalLM, config: ModelConfig,
                       shard: Shard) -> list[tuple[nn.Module, str, list[tuple[str, int, int]]]]:
    """A pre-quantised checkpoint's fused weights this rank holds: (module, attribute, its parts (checkpoint name,
    out_features, in_features) in the order they stack)."""
    linears = []
    for i, layer in enumerate(model.layers, start=shard.layer_start):
        p, proj = f"model.layers.{i}.", projections(config, i)
        for module, attr, names in ((layer.self_attn, "qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                                                   "self_attn.v_proj")),
                                    (layer.self_attn, "o_proj", ("self_attn.o_proj",)),
                                    (layer.mlp, "gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                                    (layer.mlp, "down_proj", ("mlp.down_proj",))):
            linears.append((module, attr, [(p + name, *proj[p + name]) for name in names]))
    return linears


def targets(model: Qwen2ForCausalLM, config: ModelConfig, shard: Shard) -> dict[str, list[Target]]:
    """Where each checkpoint tensor this rank holds goes (a tied embedding may feed two parameters)."""
    d = config.head_dim
    q_local, kv_local = shard.num_heads * d, shard.num_kv_heads * d
    inter = shard.intermediate_size
    heads = slice(shard.head_start * d, shard.head_start * d + q_local)
    kv_heads = slice(shard.kv_head_start * d, shard.kv_head_start * d + kv_local)
    mlp = slice(shard.intermediate_start, shard.intermediate_start + inter)
    vocab = slice(shard.vocab_start, shard.vocab_end)
    targets: dict[str, list[Target]] = {}
    if shard.first_stage:
        targets["model.embed_tokens.weight"] = [Target(model.embed_tokens, 0, vocab)]
    if shard.last_stage:
        targets["model.norm.weight"] = [Target(model.norm.weight, 0)]
        if model.lm_head is not None and model.lm_head is not model.embed_tokens:
            head_source = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            targets.setdefault(head_source, []).append(Target(model.lm_head, 0, vocab))
    for i, layer in enumerate(model.layers, start=shard.layer_start):
        p = f"model.layers.{i}."
        attn, mlp_module = layer.self_attn, layer.mlp
        for name, start, rows in (("q", 0, heads), ("k", q_local, kv_heads), ("v", q_local + kv_local, kv_heads)):
            if config.attention_bias:
                targets[f"{p}self_attn.{name}_proj.bias"] = [Target(attn.qkv_bias, start, rows)]
            if config.quantization is None:
                targets[f"{p}self_attn.{name}_proj.weight"] = [Target(attn.qkv_proj, start, rows)]
        if config.quantization is None:
            targets[f"{p}self_attn.o_proj.weight"] = [Target(attn.o_proj, 0, cols=heads)]
            targets[f"{p}mlp.gate_proj.weight"] = [Target(mlp_module.gate_up_proj, 0, mlp)]
            targets[f"{p}mlp.up_proj.weight"] = [Target(mlp_module.gate_up_proj, inter, mlp)]
            targets[f"{p}mlp.down_proj.weight"] = [Target(mlp_module.down_proj, 0, cols=mlp)]
        targets[f"{p}input_layernorm.weight"] = [Target(layer.input_layernorm.weight, 0)]
        targets[f"{p}post_attention_layernorm.weight"] = [Target(layer.post_attention_layernorm.weight, 0)]
        if config.qk_norm:  # over head_dim: every tensor rank holds all of it
            targets[f"{p}self_attn.q_norm.weight"] = [Target(attn.q_norm.weight, 0)]
            targets[f"{p}self_attn.k_norm.weight"] = [Target(attn.k_norm.weight, 0)]
    return targets


def zero_vocab_padding(model: Qwen2ForCausalLM, shard: Shard) -> None:
    """The last vocabulary slice may be shorter than the others: its padding rows embed to 0 and give logits
    of 0 that the sampler cuts off."""
    real = shard.vocab_end - shard.vocab_start
    for param in (model.embed_tokens, model.lm_head):
        if param is not None:
            param.data[real:].zero_()
