"""A GGUF file's tensors into our network (the file's directory and config: mini_infer/gguf_file.py).

llama.cpp's names map onto HF's (token_embd -> model.embed_tokens, blk.N.attn_q -> model.layers.N.self_attn.q_proj,
...; a MoE layer's experts, stacked in 3-D tensors there, one by one to mlp.experts.E), and then load as a safetensors
checkpoint's do (model/weight_map.py: the fused q/k/v and gate/up, a tensor- or pipeline-parallel rank's part only,
every tensor of its exact shape and exactly once). A GGUF lists a 2-D tensor's dimensions innermost first
([in_features, out_features]); its data is the row-major [out_features, in_features]. convert_hf_to_gguf.py permutes
the rows of a Llama model's q and k projections (each head's two rotary halves interleaved, as llama.cpp's RoPE takes
them); they are put back here.

Q8_0 (34-byte blocks: a float16 scale d and 32 int8 values q, w = d q) and Q4_0 (18 bytes: d and 16 bytes of 4-bit q,
the block's first 16 values in the low nibbles and the next 16 in the high ones, w = d (q - 8)) are mini-infer's int8
and int4 layouts with groups of 32 (kernels/quant.py, decision 002): their integers and scales load unchanged, so the
weights are exactly llama.cpp's. The K-quants keep their integers and both levels of their scales (kernels/quant.py's
two-level layout, docs/decisions/027-k-quant-layout.md): Q4_K as int4 with mins (4.625 bits a weight against the
file's 4.5), Q6_K as int6 (6.56 bits, as the file's), Q5_K with its 5-bit integers in bytes (8.625 bits against 5.5). A
fused weight whose parts are of different types (a Q4_K_M file's Q4_K q and k with a Q6_K v) keeps them apart
(StackedParts), each its own matmul. A quantised embedding is a lookup table, not a matmul: it is expanded to the
model's dtype (exact in float32); the LM head keeps the file's type (the embedding's, when the head is tied).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mini_infer.config import ModelConfig
from mini_infer.gguf_file import (BLOCK_BYTES, EXPERT_NAMES, GLOBAL_NAMES, GROUP, LAYER_NAMES, QUANTIZED_TYPES,
                                 SUPER_BLOCK, GGUFHeader, Tensor)
from mini_infer.kernels.quant import QuantizedTensor, StackedParts
from mini_infer.model import prequantized, weight_map
from mini_infer.model.qwen2 import Qwen2ForCausalLM

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (None: a name we do not know)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match is None or match[2] not in LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def named_tensors(header: GGUFHeader):
    """(HF checkpoint name or None, tensor) of each tensor of the file, a MoE layer's 3-D expert tensors split into
    one 2-D tensor per expert (its bytes a slice of the file's)."""
    for tensor in header.tensors:
        match = _BLOCK.fullmatch(tensor.name)
        if match is None or match[2] not in EXPERT_NAMES or len(tensor.shape) != 3:
            yield hf_name(tensor.name), tensor
            continue
        experts = int(tensor.shape[2])
        size = len(tensor.bytes) // experts
        for e in range(experts):
            yield (f"model.layers.{match[1]}.mlp.experts.{e}.{EXPERT_NAMES[match[2]]}.weight",
                   Tensor(f"{tensor.name}[{e}]", tensor.tensor_type, tensor.shape[:2],
                          tensor.bytes[e * size:(e + 1) * size]))


def quantized(tensor) -> QuantizedTensor:
    """A quantised tensor's blocks as a QuantizedTensor of the same integers: Q8_0 / Q4_0 with their scales as they
    are (float16 values); the K-quants (256-weight blocks of sub-blocks with int8 scales of their own) in two levels."""
    kind = tensor.tensor_type.name
    in_features, out_features = (int(n) for n in tensor.shape)
    per_block = SUPER_BLOCK if kind in _K_QUANTS else GROUP
    blocks = torch.from_numpy(np.array(tensor.data)).view(out_features, in_features // per_block, BLOCK_BYTES[kind])
    if kind in _K_QUANTS:
        return _K_QUANTS[kind](blocks, out_features, in_features)
    scales = _halves(blocks[:, :, :2]).float()
    if kind == "Q8_0":
        q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
    else:
        packed = blocks[:, :, 2:]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(out_features, in_features)
    return QuantizedTensor(q.contiguous(), scales.contiguous(), None, QUANTIZED_TYPES[kind], GROUP, in_features,
                           torch.float16, None)


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """float16 values stored as their two bytes ([..., 2] uint8) -> float16 [...]."""
    return raw.contiguous().view(torch.float16)[..., 0].contiguous()


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes per block of eight 6-bit scales and mins ([rows, blocks, 12] uint8) -> int8
    [rows, blocks * 8] each (llama.cpp's get_scale_min_k4)."""
    rows = packed.shape[0]
    words = packed.view(rows, -1, 3, 4).to(torch.int32)
    low, high, both = words[:, :, 0], words[:, :, 1], words[:, :, 2]
    sc = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return sc.to(torch.int8).reshape(rows, -1), mins.to(torch.int8).reshape(rows, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A K-quant block's 128 bytes of 4-bit values ([rows, blocks, 128]): 4 runs of 32 bytes, each run's low nibbles
    sub-block 2c and its high ones 2c + 1 -> [rows, blocks, 8, 32]."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
    return ((qs.reshape(qs.shape[0], -1, 4, 1, 32) >> shifts) & 0x0F).reshape(qs.shape[0], -1, 8, 32)


def _q4_k(blocks: torch.Tensor, rows: int, cols: int) -> QuantizedTensor:
    """Q4_K (144 bytes: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit q): sub-block j of 32
    weights is q d sc_j - dmin m_j, q in 0..15: int4 with mins, two levels, as it is."""
    sc, mins = _scales_and_mins(blocks[:, :, 4:16])
    return QuantizedTensor(_nibbles(blocks[:, :, 16:]).reshape(rows, cols).contiguous(), sc, mins, 4, GROUP, cols,
                           torch.float16, None, _halves(blocks[:, :, 0:2]), _halves(blocks[:, :, 2:4]), 8)


def _q5_k(blocks: torch.Tensor, rows: int, cols: int) -> QuantizedTensor:
    """Q5_K (176 bytes: d, dmin, the 12 bytes of scales and mins, 32 bytes of q's fifth bits -- bit j of byte l for
    sub-block j's weight l --, 128 bytes of q's low 4 bits as Q4_K's): sub-block j of 32 weights is q d sc_j -
    dmin m_j, q in 0..31: int8 with mins, two levels."""
    sc, mins = _scales_and_mins(blocks[:, :, 4:16])
    fifth = (blocks[:, :, 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1
    q = (_nibbles(blocks[:, :, 48:]) | (fifth << 4)).to(torch.int8)
    return QuantizedTensor(q.reshape(rows, cols).contiguous(), sc, mins, 8, GROUP, cols, torch.float16, None,
                           _halves(blocks[:, :, 0:2]), _halves(blocks[:, :, 2:4]), 8)


def _q6_k(blocks: torch.Tensor, rows: int, cols: int) -> QuantizedTensor:
    """Q6_K (210 bytes: 128 of q's low 4 bits, 64 of their high 2, 16 int8 scales, d): sub-block j of 16 weights is
    (q - 32) d sc_j, q in 0..63: int6 (q - 32, held in int8) in groups of 16, two levels, no mins."""
    low = blocks[:, :, :128].reshape(rows, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
    high = blocks[:, :, 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor(
        [0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    q = ((low & 0x0F).reshape(rows, -1, 8, 32) | ((high & 0x03).reshape(rows, -1, 8, 32) << 4)).to(torch.int8) - 32
    sc = blocks[:, :, 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    return QuantizedTensor(q.reshape(rows, cols).contiguous(), sc, None, 6, 16, cols, torch.float16, None,
                           _halves(blocks[:, :, 208:210]), None, 16)


_K_QUANTS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _float(tensor) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor in its own dtype, [out_features, in_features] for a 2-D one."""
    shape = [int(n) for n in reversed(tensor.shape)]
    data = np.array(tensor.data)
    if tensor.tensor_type.name == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(data).reshape(shape)


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's Llama q/k row order undone: per head, [half 0 row i, half 1 row i] pairs back to the
    two halves one after the other."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _unpermuted(q: QuantizedTensor, heads: int) -> QuantizedTensor:
    return replace(q, **{name: _unpermute(t, heads).contiguous() for name, t in q.row_tensors().items()})


def load_gguf_weights(model: Qwen2ForCausalLM, config: ModelConfig, file: Path,
                      prepare: Callable[[list[tuple[nn.Module, str]]], None] | None = None) -> None:
    """Load the file's tensors into `model`. A quantised projection is set as soon as the last of its parts is read
    and handed to `prepare` (Ops.prepare: packed for its kernels) there and then, so that no more than one layer's
    unpacked integers are alive at a time (a 30B model's would not fit 24 GiB beside their packed form)."""
    shard = model.shard
    float_config = replace(config, quantization=None)  # every tensor's float shape and target
    shapes = weight_map.expected_shapes(float_config, model.has_lm_head)
    targets = weight_map.targets(model, float_config, shard)
    linears = weight_map.quantized_linears(model, config, shard)
    permuted = {}
    if config.architecture == "LlamaForCausalLM":
        permuted = {f"model.layers.{i}.self_attn.{p}_proj.weight": heads for i in range(config.num_hidden_layers)
                    for p, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads))}
    weight_map.zero_vocab_padding(model, shard)
    if not config.attention_bias:
        for layer in model.layers:
            layer.self_attn.qkv_bias.data.zero_()
    held: dict[str, QuantizedTensor] = {}  # quantised projections (without .weight) this rank holds
    linear_of = {name: (module, attr, parts) for module, attr, parts in linears for name, _, _ in parts}

    def set_linear(module: nn.Module, attr: str, parts) -> None:
        stored = [held.pop(name) for name, _, _ in parts]
        module._parameters.pop(attr)
        if len({s.scheme for s in stored}) > 1:  # (a Q4_K_M file: q and k in Q4_K, v in Q6_K) each its own matmul
            setattr(module, attr, StackedParts(tuple(stored)))
        else:
            setattr(module, attr, prequantized.concat(stored, f"{parts[0][0]} ({attr})"))
        if prepare is not None:
            prepare([(module, attr)])

    head: QuantizedTensor | None = None
    loaded: set[str] = set()
    for name, tensor in named_tensors(GGUFHeader(file)):
        if tensor.name == "rope_freqs.weight":
            continue  # in the config (gguf_file.py: rope_freq_factors)
        if name is None or name not in shapes:
            raise ValueError(f"{file}: unexpected tensor {tensor.name!r} for a {config.architecture} model of this "
                             "config")
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp's vector, HF's one row
            shape = (1, *shape)
        if shape != shapes[name]:
            raise ValueError(f"{file}: tensor {tensor.name!r} ({name}) has shape {shape}, expected {shapes[name]}")
        loaded.add(name)
        is_quantized = tensor.tensor_type.name in QUANTIZED_TYPES
        lm_head = name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings)
        if is_quantized and (name[:-len(".weight")] in linear_of or (lm_head and model.has_lm_head)):
            value = quantized(tensor)
            if name in permuted:
                value = _unpermuted(value, permuted[name])
            projection = name[:-len(".weight")]
            if projection in linear_of:
                held[projection] = value
                module, attr, parts = linear_of[projection]
                if all(part in held for part, _, _ in parts):
                    set_linear(module, attr, parts)
                continue
            head = value
            if name == "lm_head.weight":
                continue
        if name not in targets:
            continue  # another rank's tensor
        if is_quantized:  # (a tied head's embedding: the head's integers and scales, expanded)
            value = (head if lm_head and head is not None else quantized(tensor)).dequantize()
        else:
            value = _float(tensor).reshape(shape)
        if name in permuted:
            value = _unpermute(value, permuted[name])
        for target in targets[name]:
            part = value[target.rows] if value.dim() == 1 else value[target.rows, target.cols]
            target.param.data[target.row_start: target.row_start + part.shape[0]].copy_(part)
    missing = sorted(set(shapes) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{file}: GGUF file is missing tensors: {shown}")
    for module, attr, parts in linears:
        if any(name in held for name, _, _ in parts):
            raise ValueError(f"{file}: {parts[0][0]} ({attr}): the fused projections {[n for n, _, _ in parts]} "
                             "are stored some quantised, some float; mini-infer fuses those of one kind")
    if head is not None:
        model._parameters.pop("lm_head", None)
        model.lm_head = head
