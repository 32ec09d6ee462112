"""Load a local HF-format Qwen2 checkpoint (safetensors only) into our network.

HF's separate q/k/v and gate/up tensors are copied into slices of our fused parameters; every expected
tensor must arrive exactly once with its exact shape, and nothing unknown may be left over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mini_infer.config import ModelConfig
from mini_infer.model.ops import Ops
from mini_infer.model.qwen2 import Qwen2ForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; we compute them


@dataclass(frozen=True, slots=True)
class _Target:
    param: torch.nn.Parameter
    row_start: int
    shape: tuple[int, ...]


def checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name}, which is missing from {model_dir}")
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir}: only safetensors checkpoints are loaded (pickle .bin/.pt files are not)")
    raise FileNotFoundError(f"{model_dir}: no model.safetensors and no model.safetensors.index.json")


def _targets(model: Qwen2ForCausalLM, config: ModelConfig) -> dict[str, _Target]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    targets = {
        "model.embed_tokens.weight": _Target(model.embed_tokens, 0, (config.vocab_size, hidden)),
        "model.norm.weight": _Target(model.norm.weight, 0, (hidden,)),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _Target(model.lm_head, 0, (config.vocab_size, hidden))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name, start, size in (("q", 0, q_size), ("k", q_size, kv_size), ("v", q_size + kv_size, kv_size)):
            targets[f"{p}self_attn.{name}_proj.weight"] = _Target(attn.qkv_proj, start, (size, hidden))
            targets[f"{p}self_attn.{name}_proj.bias"] = _Target(attn.qkv_bias, start, (size,))
        targets[f"{p}self_attn.o_proj.weight"] = _Target(attn.o_proj, 0, (hidden, q_size))
        targets[f"{p}mlp.gate_proj.weight"] = _Target(mlp.gate_up_proj, 0, (inter, hidden))
        targets[f"{p}mlp.up_proj.weight"] = _Target(mlp.gate_up_proj, inter, (inter, hidden))
        targets[f"{p}mlp.down_proj.weight"] = _Target(mlp.down_proj, 0, (hidden, inter))
        targets[f"{p}input_layernorm.weight"] = _Target(layer.input_layernorm.weight, 0, (hidden,))
        targets[f"{p}post_attention_layernorm.weight"] = _Target(layer.post_attention_layernorm.weight, 0, (hidden,))
    return targets


def _ignorable(name: str, config: ModelConfig) -> bool:
    # Tied checkpoints sometimes still carry lm_head.weight; the embedding is the head then.
    return name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


def load_weights(model: Qwen2ForCausalLM, config: ModelConfig, model_dir: Path) -> None:
    targets = _targets(model, config)
    loaded: set[str] = set()
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    if _ignorable(name, config):
                        continue
                    raise ValueError(f"{file}: unexpected tensor {name!r} for a Qwen2 model of this config")
                if name in loaded:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != target.shape:
                    raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {target.shape} from config.json")
                target.param.data[target.row_start: target.row_start + target.shape[0]].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{model_dir}: checkpoint is missing tensors: {shown}")


def load_model(config: ModelConfig, model_dir: Path, *, dtype: torch.dtype, device: str, max_positions: int,
               ops: Ops) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops)
    load_weights(model, config, model_dir)
    ops.prepare(model.linear_weights())
    return model.eval()
