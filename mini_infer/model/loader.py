"""Load a local HF-format Qwen2, Qwen3 or Llama checkpoint (safetensors only) into our network, or into one rank's
shard of it.

HF's separate q/k/v and gate/up tensors are copied into slices of our fused parameters; a tensor- or pipeline-
parallel rank reads only its own slice of each tensor it holds (safetensors slices, so the rest is never loaded)
and skips the layers of other stages. Every tensor must have its exact checkpoint shape, every one this rank
holds must arrive exactly once, and nothing unknown may be left over. A base model's tensors (saved from Qwen3Model,
say, as sentence-transformers checkpoints are) come without the "model." prefix; a model built without an LM head
(an embedding model's) expects none and ignores a checkpoint's.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mini_infer import gguf_file
from mini_infer.config import ModelConfig
from mini_infer.distributed.comm import Comm
from mini_infer.distributed.shard import Shard
from mini_infer.model import prequantized
from mini_infer.model.ops import Ops
from mini_infer.model.qwen2 import Qwen2ForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; we compute them


@dataclass(frozen=True, slots=True)
class _Target:
    """Copy checkpoint[rows, cols] into param[row_start : row_start + len(rows)]."""

    param: torch.nn.Parameter
    row_start: int
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))


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


def _projections(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """Layer `layer`'s projections in the checkpoint (name without .weight -> [out_features, in_features])."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    p = f"model.layers.{layer}."
    return {f"{p}self_attn.q_proj": (q_size, hidden), f"{p}self_attn.k_proj": (kv_size, hidden),
            f"{p}self_attn.v_proj": (kv_size, hidden), f"{p}self_attn.o_proj": (hidden, q_size),
            f"{p}mlp.gate_proj": (inter, hidden), f"{p}mlp.up_proj": (inter, hidden),
            f"{p}mlp.down_proj": (hidden, inter)}


def _expected_shapes(config: ModelConfig, lm_head: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole checkpoint with its shape (lm_head only when the model has one, untied); a
    pre-quantised checkpoint's projections as their packed tensors (prequantized.packed_shapes), g_idx optional
    without act-order."""
    hidden = config.hidden_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if lm_head and not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p, projections = f"model.layers.{i}.", _projections(config, i)
        for name, (out_features, in_features) in projections.items():
            if config.quantization is None:
                shapes[f"{name}.weight"] = (out_features, in_features)
                continue
            packed = prequantized.packed_shapes(config.quantization, out_features, in_features)
            shapes.update({f"{name}.{suffix}": shape for suffix, (shape, _) in packed.items()})
        for name in ("q", "k", "v") if config.attention_bias else ():
            shapes[f"{p}self_attn.{name}_proj.bias"] = (projections[f"{p}self_attn.{name}_proj"][0],)
        shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def _optional(name: str, config: ModelConfig) -> bool:
    """A tensor the checkpoint may leave out: GPTQ's g_idx without act-order (the inputs are then in group order)."""
    quant = config.quantization
    return quant is not None and quant.method == "gptq" and not quant.desc_act and name.endswith(".g_idx")


def _quantized_linears(model: Qwen2ForCausalLM, config: ModelConfig,
                       shard: Shard) -> list[tuple[nn.Module, str, list[tuple[str, int, int]]]]:
    """A pre-quantised checkpoint's fused weights this rank holds: (module, attribute, its parts (checkpoint name,
    out_features, in_features) in the order they stack)."""
    linears = []
    for i, layer in enumerate(model.layers, start=shard.layer_start):
        p, proj = f"model.layers.{i}.", _projections(config, i)
        for module, attr, names in ((layer.self_attn, "qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                                                   "self_attn.v_proj")),
                                    (layer.self_attn, "o_proj", ("self_attn.o_proj",)),
                                    (layer.mlp, "gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                                    (layer.mlp, "down_proj", ("mlp.down_proj",))):
            linears.append((module, attr, [(p + name, *proj[p + name]) for name in names]))
    return linears


def _targets(model: Qwen2ForCausalLM, config: ModelConfig, shard: Shard) -> dict[str, list[_Target]]:
    """Where each checkpoint tensor this rank holds goes (a tied embedding may feed two parameters)."""
    d = config.head_dim
    q_local, kv_local = shard.num_heads * d, shard.num_kv_heads * d
    inter = shard.intermediate_size
    heads = slice(shard.head_start * d, shard.head_start * d + q_local)
    kv_heads = slice(shard.kv_head_start * d, shard.kv_head_start * d + kv_local)
    mlp = slice(shard.intermediate_start, shard.intermediate_start + inter)
    vocab = slice(shard.vocab_start, shard.vocab_end)
    targets: dict[str, list[_Target]] = {}
    if shard.first_stage:
        targets["model.embed_tokens.weight"] = [_Target(model.embed_tokens, 0, vocab)]
    if shard.last_stage:
        targets["model.norm.weight"] = [_Target(model.norm.weight, 0)]
        if model.lm_head is not None and model.lm_head is not model.embed_tokens:
            head_source = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            targets.setdefault(head_source, []).append(_Target(model.lm_head, 0, vocab))
    for i, layer in enumerate(model.layers, start=shard.layer_start):
        p = f"model.layers.{i}."
        attn, mlp_module = layer.self_attn, layer.mlp
        for name, start, rows in (("q", 0, heads), ("k", q_local, kv_heads), ("v", q_local + kv_local, kv_heads)):
            if config.attention_bias:
                targets[f"{p}self_attn.{name}_proj.bias"] = [_Target(attn.qkv_bias, start, rows)]
            if config.quantization is None:
                targets[f"{p}self_attn.{name}_proj.weight"] = [_Target(attn.qkv_proj, start, rows)]
        if config.quantization is None:
            targets[f"{p}self_attn.o_proj.weight"] = [_Target(attn.o_proj, 0, cols=heads)]
            targets[f"{p}mlp.gate_proj.weight"] = [_Target(mlp_module.gate_up_proj, 0, mlp)]
            targets[f"{p}mlp.up_proj.weight"] = [_Target(mlp_module.gate_up_proj, inter, mlp)]
            targets[f"{p}mlp.down_proj.weight"] = [_Target(mlp_module.down_proj, 0, cols=mlp)]
        targets[f"{p}input_layernorm.weight"] = [_Target(layer.input_layernorm.weight, 0)]
        targets[f"{p}post_attention_layernorm.weight"] = [_Target(layer.post_attention_layernorm.weight, 0)]
        if config.qk_norm:  # over head_dim: every tensor rank holds all of it
            targets[f"{p}self_attn.q_norm.weight"] = [_Target(attn.q_norm.weight, 0)]
            targets[f"{p}self_attn.k_norm.weight"] = [_Target(attn.k_norm.weight, 0)]
    return targets


def _ignorable(name: str, config: ModelConfig, lm_head: bool) -> bool:
    # Tied checkpoints sometimes still carry lm_head.weight; the embedding is the head then. A model without a head
    # (an embedding model's) has no use for one.
    return name.endswith(_IGNORED_SUFFIXES) or ((config.tie_word_embeddings or not lm_head)
                                                and name == "lm_head.weight")


def load_weights(model: Qwen2ForCausalLM, config: ModelConfig, model_dir: Path) -> None:
    if (model_dir / gguf_file.LINK).exists():  # a GGUF file's directory (gguf_file.py)
        from mini_infer.model.gguf_weights import load_gguf_weights  # (it builds on this module's helpers)

        return load_gguf_weights(model, config, model_dir / gguf_file.LINK)
    shard = model.shard
    lm_head = model.has_lm_head
    shapes = _expected_shapes(config, lm_head)
    targets = _targets(model, config, shard)
    linears = _quantized_linears(model, config, shard) if config.quantization is not None else []
    # this rank's pre-quantised tensors: checkpoint name -> (its projection, suffix, the dtypes it may have)
    held = {f"{name}.{suffix}": (name, suffix, dtypes) for _, _, parts in linears for name, out_features, in_features
            in parts for suffix, (_, dtypes) in prequantized.packed_shapes(config.quantization, out_features,
                                                                           in_features).items()}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # projection -> suffix -> tensor, unpacked once all are read
    _zero_vocab_padding(model, shard)
    if not config.attention_bias:  # no bias in the checkpoint: the fused QKV's is zero
        for layer in model.layers:
            layer.self_attn.qkv_bias.data.zero_()
    loaded: set[str] = set()
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                # A base model's tensors are saved without the "model." prefix.
                name = stored if stored in shapes or f"model.{stored}" not in shapes else f"model.{stored}"
                if name not in shapes:
                    if _ignorable(name, config, lm_head):
                        continue
                    raise ValueError(f"{file}: unexpected tensor {name!r} for a {config.architecture} model of this "
                                     "config")
                if name in loaded:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                tensor = f.get_slice(stored)
                shape = tuple(tensor.get_shape())
                if shape != shapes[name]:
                    raise ValueError(f"{file}: tensor {name!r} has shape {shape}, expected {shapes[name]} "
                                     "from config.json")
                loaded.add(name)
                if name in held:
                    projection, suffix, dtypes = held[name]
                    packed.setdefault(projection, {})[suffix] = _packed_tensor(tensor, name, dtypes, file)
                for target in targets.get(name, ()):  # none: another rank's tensor
                    part = tensor[target.rows] if len(shape) == 1 else tensor[target.rows, target.cols]
                    target.param.data[target.row_start: target.row_start + part.shape[0]].copy_(part)
    missing = sorted(name for name in set(shapes) - loaded if not _optional(name, config))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{model_dir}: checkpoint is missing tensors: {shown}")
    for module, attr, parts in linears:
        weights = [prequantized.unpack(config.quantization, packed.pop(name), out_features, in_features, name)
                   for name, out_features, in_features in parts]
        module._parameters.pop(attr)
        setattr(module, attr, prequantized.concat(weights, f"{parts[0][0]} ({attr})"))


def _packed_tensor(tensor, name: str, dtypes: tuple[torch.dtype, ...], file: Path) -> torch.Tensor:
    """A pre-quantised projection's stored tensor, read whole, once its dtype is checked."""
    value = tensor[:]
    if value.dtype not in dtypes:
        raise ValueError(f"{file}: tensor {name!r} is {value.dtype}, expected {' or '.join(map(str, dtypes))}")
    return value


def _zero_vocab_padding(model: Qwen2ForCausalLM, shard: Shard) -> None:
    """The last vocabulary slice may be shorter than the others: its padding rows embed to 0 and give logits
    of 0 that the sampler cuts off."""
    real = shard.vocab_end - shard.vocab_start
    for param in (model.embed_tokens, model.lm_head):
        if param is not None:
            param.data[real:].zero_()


def load_model(config: ModelConfig, model_dir: Path, *, dtype: torch.dtype, device: str, max_positions: int,
               ops: Ops, comm: Comm, lm_head: bool = True) -> Qwen2ForCausalLM:
    """The network loaded from the checkpoint, with an LM head unless `lm_head` is False (an embedding model's)."""
    model = Qwen2ForCausalLM(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                             shard=comm.shard, comm=comm, lm_head=lm_head)
    load_weights(model, config, model_dir)
    ops.prepare(model.linear_weights())
    if ops.quantization is not None:
        _release_freed_memory()  # the float weights just quantised: give their pages back, not only to malloc
    return model.eval()


def _release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; malloc_trim returns it to the OS (elsewhere: nothing to do)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
