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
from mini_infer.model.moe import swiglu_mlps
from mini_infer.model.qwen2 import Qwen2ForCausalLM


@dataclass(frozen=True, slots=True)
class Target:
    """Copy checkpoint[rows, cols] into param[row_start : row_start + len(rows)]."""

    param: torch.nn.Parameter
    row_start: int
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))


def mlps(config: ModelConfig, layer: int) -> dict[str, int]:
    """Layer `layer`'s SwiGLU MLPs in the checkpoint (name prefix -> intermediate size): the dense one, or a sparse
    layer's experts and shared expert (in moe.swiglu_mlps' order)."""
    p = f"model.layers.{layer}.mlp"
    if not config.sparse(layer):
        return {p: config.intermediate_size}
    moe = config.moe
    found = {f"{p}.experts.{e}": moe.intermediate_size for e in range(moe.num_experts)}
    return found | ({f"{p}.shared_expert": moe.shared_expert_intermediate_size}
                    if moe.shared_expert_intermediate_size else {})


def projections(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """Layer `layer`'s projections in the checkpoint (name without .weight -> [out_features, in_features]); not a
    sparse layer's router and shared-expert gate (router_shapes), which stay in the model's dtype."""
    hidden = config.hidden_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    p = f"model.layers.{layer}."
    found = {f"{p}self_attn.q_proj": (q_size, hidden), f"{p}self_attn.k_proj": (kv_size, hidden),
             f"{p}self_attn.v_proj": (kv_size, hidden), f"{p}self_attn.o_proj": (hidden, q_size)}
    for mlp, inter in mlps(config, layer).items():
        found |= {f"{mlp}.gate_proj": (inter, hidden), f"{mlp}.up_proj": (inter, hidden),
                  f"{mlp}.down_proj": (hidden, inter)}
    return found


def router_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """A sparse layer's router and (Qwen2-MoE) shared-expert gate (full names -> shape); none for a dense layer."""
    if not config.sparse(layer):
        return {}
    p, hidden = f"model.layers.{layer}.mlp.", config.hidden_size
    found = {f"{p}gate.weight": (config.moe.num_experts, hidden)}
    return found | ({f"{p}shared_expert_gate.weight": (1, hidden)} if config.moe.shared_expert_intermediate_size
                    else {})


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
        shapes |= router_shapes(config, i)
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
        parts = [(layer.self_attn, "qkv_proj", (f"{p}self_attn.q_proj", f"{p}self_attn.k_proj",
                                                f"{p}self_attn.v_proj")),
                 (layer.self_attn, "o_proj", (f"{p}self_attn.o_proj",))]
        for module, name in zip(swiglu_mlps(layer.mlp), mlps(config, i)):
            parts += [(module, "gate_up_proj", (f"{name}.gate_proj", f"{name}.up_proj")),
                      (module, "down_proj", (f"{name}.down_proj",))]
        linears += [(module, attr, [(name, *proj[name]) for name in names]) for module, attr, names in parts]
    return linears


def targets(model: Qwen2ForCausalLM, config: ModelConfig, shard: Shard) -> dict[str, list[Target]]:
    """Where each checkpoint tensor this rank holds goes (a tied embedding may feed two parameters)."""
    d = config.head_dim
    q_local, kv_local = shard.num_heads * d, shard.num_kv_heads * d
    heads = slice(shard.head_start * d, shard.head_start * d + q_local)
    kv_heads = slice(shard.kv_head_start * d, shard.kv_head_start * d + kv_local)
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
        attn = layer.self_attn
        for name, start, rows in (("q", 0, heads), ("k", q_local, kv_heads), ("v", q_local + kv_local, kv_heads)):
            if config.attention_bias:
                targets[f"{p}self_attn.{name}_proj.bias"] = [Target(attn.qkv_bias, start, rows)]
            if config.quantization is None:
                targets[f"{p}self_attn.{name}_proj.weight"] = [Target(attn.qkv_proj, start, rows)]
        if config.quantization is None:
            targets[f"{p}self_attn.o_proj.weight"] = [Target(attn.o_proj, 0, cols=heads)]
            for module, (name, size) in zip(swiglu_mlps(layer.mlp), mlps(config, i).items()):
                columns, local = shard.intermediate_slice(size), size // shard.tp_size
                targets[f"{name}.gate_proj.weight"] = [Target(module.gate_up_proj, 0, columns)]
                targets[f"{name}.up_proj.weight"] = [Target(module.gate_up_proj, local, columns)]
                targets[f"{name}.down_proj.weight"] = [Target(module.down_proj, 0, cols=columns)]
        if config.sparse(i):  # the router and the shared expert's gate: whole on every tensor rank
            targets[f"{p}mlp.gate.weight"] = [Target(layer.mlp.gate, 0)]
            if layer.mlp.shared_expert_gate is not None:
                targets[f"{p}mlp.shared_expert_gate.weight"] = [Target(layer.mlp.shared_expert_gate, 0)]
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
