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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mini_infer import gguf_file
from mini_infer.config import ModelConfig
from mini_infer.distributed.comm import Comm
from mini_infer.model import prequantized, weight_map
from mini_infer.model.gguf_weights import load_gguf_weights
from mini_infer.model.ops import Ops
from mini_infer.model.qwen2 import Qwen2ForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; we compute them


def checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        index_map = json.loads(index.read_text()).get("weight_map")
        if not index_map:
            raise ValueError(f"{index}: no weight_map")
        files = [model_dir / name for name in sorted(set(index_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name}, which is missing from {model_dir}")
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir}: only safetensors checkpoints are loaded (pickle .bin/.pt files are not)")
    raise FileNotFoundError(f"{model_dir}: no model.safetensors and no model.safetensors.index.json")


def _ignorable(name: str, config: ModelConfig, lm_head: bool) -> bool:
    # Tied checkpoints sometimes still carry lm_head.weight; the embedding is the head then. A model without a head
    # (an embedding model's) has no use for one.
    return name.endswith(_IGNORED_SUFFIXES) or ((config.tie_word_embeddings or not lm_head)
                                                and name == "lm_head.weight")


def load_weights(model: Qwen2ForCausalLM, config: ModelConfig, model_dir: Path,
                 prepare: Callable[[list[tuple[nn.Module, str]]], None] | None = None) -> None:
    """Load the checkpoint's tensors into `model`; a GGUF file's quantised projections go through `prepare` as they
    are read (gguf_weights.load_gguf_weights)."""
    if (model_dir / gguf_file.LINK).exists():  # a GGUF file's directory (gguf_file.py)
        return load_gguf_weights(model, config, model_dir / gguf_file.LINK, prepare)
    shard = model.shard
    lm_head = model.has_lm_head
    shapes = weight_map.expected_shapes(config, lm_head)
    targets = weight_map.targets(model, config, shard)
    linears = weight_map.quantized_linears(model, config, shard) if config.quantization is not None else []
    # this rank's pre-quantised tensors: checkpoint name -> (its projection, suffix, the dtypes it may have)
    held = {f"{name}.{suffix}": (name, suffix, dtypes) for _, _, parts in linears for name, out_features, in_features
            in parts for suffix, (_, dtypes) in prequantized.packed_shapes(config.quantization, out_features,
                                                                           in_features).items()}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # projection -> suffix -> tensor, unpacked once all are read
    weight_map.zero_vocab_padding(model, shard)
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
    missing = sorted(name for name in set(shapes) - loaded if not weight_map.optional(name, config))
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


def load_model(config: ModelConfig, model_dir: Path, *, dtype: torch.dtype, device: str, max_positions: int,
               ops: Ops, comm: Comm, lm_head: bool = True) -> Qwen2ForCausalLM:
    """The network loaded from the checkpoint, with an LM head unless `lm_head` is False (an embedding model's)."""
    model = Qwen2ForCausalLM(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                             shard=comm.shard, comm=comm, lm_head=lm_head)
    load_weights(model, config, model_dir, ops.prepare)
    ops.prepare(model.linear_weights())
    if ops.quantization is not None:
        release_freed_memory()  # the float weights just quantised: give their pages back, not only to malloc
    return model.eval()


def release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; malloc_trim returns it to the OS (elsewhere: nothing to do)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
