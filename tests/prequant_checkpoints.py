"""GPTQ and AWQ checkpoints of a random tiny Qwen2 model, packed as the formats store them, and the formats'
documented unpacking, written here once (independently of mini_infer.model.prequantized) as the reference.

GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq" = v1): qweight int32 [K / (32 / bits), N], row r holding inputs
r * (32 / bits) + j in bits j * bits and up; qzeros int32 [groups, N / (32 / bits)] likewise along the outputs,
storing zero - 1 (v2: the zero itself); scales float16 [groups, N]; g_idx int32 [K]; W[n, k] = scales[g_idx[k], n] *
(q[k, n] - zero[g_idx[k], n]). AWQ GEMM (AutoAWQ's WQLinear_GEMM): qweight int32 [K, N / 8], word i of row k holding
column 8 i + ORDER[j] in bits 4 j and up, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [groups, N / 8] likewise; scales
[groups, N]; g = k // group_size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _words(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack non-negative integers `bits` wide into int32 words along `axis` (0: rows, 1: columns), the j-th
    field of a word taking element j (or order[j]) of its run."""
    per = 32 // bits
    values = (values.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint64)  # v1's zero - 1 of a zero 0: all ones
    if axis == 0:
        runs = values.reshape(values.shape[0] // per, per, values.shape[1])
        fields = [runs[:, j, :] for j in range(per)]
    else:
        runs = values.reshape(values.shape[0], values.shape[1] // per, per)
        fields = [runs[:, :, (order or list(range(per)))[j]] for j in range(per)]
    words = np.zeros(fields[0].shape, dtype=np.uint64)
    for j, field in enumerate(fields):
        words |= field << np.uint64(bits * j)
    return _to_int32(words)


def _fields(words: torch.Tensor, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """The documented unpacking: field j of each word back to element j (or order[j]) of its run."""
    per = 32 // bits
    raw = words.numpy().view(np.uint32).astype(np.int64)
    mask = (1 << bits) - 1
    if axis == 0:
        out = np.zeros((raw.shape[0] * per, raw.shape[1]), dtype=np.int64)
        for j in range(per):
            out[j::per, :] = (raw >> (bits * j)) & mask
    else:
        out = np.zeros((raw.shape[0], raw.shape[1] * per), dtype=np.int64)
        for j in range(per):
            out[:, (order or list(range(per)))[j]::per] = (raw >> (bits * j)) & mask
    return out


def reference_dequantize(method: str, tensors: dict[str, torch.Tensor], bits: int, group_size: int,
                         in_features: int, v1: bool = True) -> torch.Tensor:
    """The float32 weight [N, K] a layer's stored tensors stand for, by the formats' documented unpacking."""
    scales = tensors["scales"].float().numpy()
    if method == "awq":
        q = _fields(tensors["qweight"], 4, 1, AWQ_ORDER)
        zeros = _fields(tensors["qzeros"], 4, 1, AWQ_ORDER)
        g_idx = np.arange(in_features) // (in_features if group_size == -1 else group_size)
    else:
        q = _fields(tensors["qweight"], bits, 0)
        zeros = _fields(tensors["qzeros"], bits, 1) + (1 if v1 else 0)
        g_idx = tensors["g_idx"].numpy().astype(np.int64)
    weight = (scales[g_idx] * (q - zeros[g_idx]).astype(np.float32)).astype(np.float32)  # [K, N]
    return torch.from_numpy(np.ascontiguousarray(weight.T))


def quantize_layer(weight: torch.Tensor, method: str, bits: int, group_size: int, sym: bool,
                   perm: torch.Tensor | None, v1: bool = True) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantisation of a float weight [N, K] into the stored tensors of `method` (scales float16;
    `perm`: act-order, the inputs' order by which groups are formed)."""
    w = weight.double().T.numpy()  # [K, N]
    K, N = w.shape
    group = K if group_size == -1 else group_size
    order = perm.numpy() if perm is not None else np.arange(K)
    g_idx = np.empty(K, dtype=np.int64)
    g_idx[order] = np.arange(K) // group
    groups = -(-K // group)
    maxq = (1 << bits) - 1
    scales = np.zeros((groups, N))
    zeros = np.zeros((groups, N), dtype=np.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        low, high = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            high = np.maximum(-low, high)
            low = -high
        s = np.where(high > low, (high - low) / maxq, 1.0)
        scales[g] = np.float16(s).astype(np.float64)
        zeros[g] = (maxq + 1) // 2 if sym else np.clip(np.round(-low / scales[g]), 0, maxq)
    q = np.clip(np.round(w / scales[g_idx]) + zeros[g_idx], 0, maxq).astype(np.int64)
    out = {"scales": torch.from_numpy(scales).to(torch.float16)}
    if method == "awq":
        out["qweight"] = _words(q, 4, 1, AWQ_ORDER)
        out["qzeros"] = _words(zeros, 4, 1, AWQ_ORDER)
    else:
        out["qweight"] = _words(q, bits, 0)
        out["qzeros"] = _words(zeros - (1 if v1 else 0), bits, 1)
        out["g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    return out


def write_quantized(model, out_dir: Path, method: str, bits: int = 4, group_size: int = 32, sym: bool = True,
                    desc_act: bool = False, v1: bool = True, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """Quantise an HF float64 Qwen2 model's projections into a `method` checkpoint at out_dir (its other tensors
    float16, as published GPTQ/AWQ checkpoints hold them), and set the model's tensors to what the checkpoint
    stands for (the projections to their reference dequantisation), so the model is the float reference. Returns
    the directory and each projection's reference weight."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(param.to(torch.float16).double())
        for i, layer in enumerate(model.model.layers):
            hidden_perm = torch.randperm(model.config.hidden_size, generator=gen) if desc_act else None
            perms = {"self_attn.q_proj": hidden_perm, "self_attn.k_proj": hidden_perm,
                     "self_attn.v_proj": hidden_perm, "mlp.gate_proj": hidden_perm, "mlp.up_proj": hidden_perm}
            for proj in PROJECTIONS:
                linear = layer.get_submodule(proj)
                in_features = linear.weight.shape[1]
                perm = perms.get(proj, torch.randperm(in_features, generator=gen) if desc_act else None)
                stored = quantize_layer(linear.weight, method, bits, group_size, sym, perm, v1)
                prefix = f"model.layers.{i}.{proj}"
                tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
                if method == "gptq" and not desc_act and i == 0 and proj == "mlp.down_proj":
                    del tensors[f"{prefix}.g_idx"]  # without act-order the inputs are in group order: may be left out
                reference[prefix] = reference_dequantize(method, stored, bits, group_size, in_features, v1)
                linear.weight.copy_(reference[prefix].double())
                if linear.bias is not None:
                    tensors[f"{prefix}.bias"] = linear.bias.to(torch.float16).contiguous()
    for name, param in model.named_parameters():
        if name.endswith(("embed_tokens.weight", "norm.weight", "layernorm.weight")) or name == "lm_head.weight":
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            tensors[name] = param.detach().to(torch.float16).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    if seed % 2:  # top-level rope_theta, as Qwen's published GPTQ/AWQ checkpoints spell it
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["architectures"] = ["Qwen2ForCausalLM"]
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    quant = {"quant_method": method, "bits": bits, "group_size": group_size}
    if method == "gptq":
        quant.update(desc_act=desc_act, sym=sym, checkpoint_format="gptq" if v1 else "gptq_v2")
    else:
        quant.update(zero_point=True, version="gemm")
    config["quantization_config"] = quant
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir, reference
