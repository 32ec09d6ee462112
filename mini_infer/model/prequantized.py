"""Pre-quantised checkpoints' linear weights (GPTQ, AWQ) as the QuantizedTensor the native kernels run.

GPTQ ("gptq" / "gptq_v2" checkpoint formats): qweight int32 [K * bits / 32, N] holds each input's integer q in
`bits`-bit fields along the input dimension, lowest bits first; qzeros int32 [groups, N * bits / 32] the zero points
z along the output dimension (v1 stores z - 1: the field plus one is z); scales [groups, N]; g_idx int32 [K] the group
of each input (act-order checkpoints permute them). W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k].

AWQ (GEMM packing): qweight int32 [K, N / 8] holds 8 columns per word, column 8 i + t in nibble AWQ_NIBBLE[t]; qzeros
[groups, N / 8] likewise; scales [groups, N]; group g = k // group_size. W[n, k] = scales[g, n] * (q[k, n] - z[g, n]).

Both become w = q * s (int8: q - 128 with z = 128, the symmetric case, the only 8-bit one loaded) or
(q - 8) * s + zero with zero = (8 - z) * s (int4), exactly, in float32: s is a float16 value times an integer of at
most 5 bits. Act-order inputs are sorted into contiguous groups (QuantizedTensor.perm, read back as x[:, perm]); a
group larger than the kernel takes (512 inputs; one group per row: K) repeats its scale over smaller ones.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mini_infer.config import CheckpointQuantization
from mini_infer.kernels.quant import QuantizedTensor

AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8 i + t of a word sits in nibble AWQ_NIBBLE[t]
MAX_GROUP = 512  # inputs per scale that cpu_gemm_quant.cpp takes
_FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)


def packed_shapes(quant: CheckpointQuantization, out_features: int,
                  in_features: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """The tensors (suffix -> shape, allowed dtypes) a linear weight of [out_features, in_features] is stored as."""
    per = 32 // quant.bits
    group = in_features if quant.group_size == -1 else quant.group_size
    groups = -(-in_features // group)
    for size, name, multiple in ((in_features, "in", per if quant.method == "gptq" else 1),
                                 (out_features, "out", per), (in_features, "in", 8)):
        if size % multiple:
            raise ValueError(f"a {quant.method} weight of {out_features} x {in_features}: {name}_features must be a "
                             f"multiple of {multiple}")
    int32 = (torch.int32,)
    if quant.method == "awq":
        return {"qweight": ((in_features, out_features // per), int32),
                "qzeros": ((groups, out_features // per), int32), "scales": ((groups, out_features), _FLOAT_SCALES)}
    return {"qweight": ((in_features // per, out_features), int32), "qzeros": ((groups, out_features // per), int32),
            "scales": ((groups, out_features), _FLOAT_SCALES), "g_idx": ((in_features,), int32)}


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [R, C] -> their 32 / bits fields [R, C, 32 / bits], lowest bits first, as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def unpack(quant: CheckpointQuantization, tensors: dict[str, torch.Tensor], out_features: int, in_features: int,
           name: str) -> QuantizedTensor:
    """One linear weight's stored tensors (packed_shapes' suffixes; g_idx may be absent without act-order) ->
    the QuantizedTensor of exactly the weights they stand for."""
    K, N, bits = in_features, out_features, quant.bits
    group = K if quant.group_size == -1 else quant.group_size
    scales = tensors["scales"]
    if quant.method == "awq":
        q = _fields(tensors["qweight"], 4)[:, :, AWQ_NIBBLE].reshape(K, N)
        zeros = _fields(tensors["qzeros"], 4)[:, :, AWQ_NIBBLE].reshape(-1, N)
        g_idx = None
    else:
        q = _fields(tensors["qweight"], bits).permute(0, 2, 1).reshape(K, N)
        zeros = _fields(tensors["qzeros"], bits).reshape(-1, N) + quant.zero_offset
        g_idx = tensors.get("g_idx")
        if g_idx is None and quant.desc_act:
            raise ValueError(f"{name}: g_idx is missing (desc_act true: it maps each input to its group)")
    in_order = torch.arange(K) // group
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), in_order):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], in_order):
            raise ValueError(f"{name}: g_idx does not give each group {group} inputs (act-order groups of the "
                             "checkpoint's group_size)")
        q = q[perm]
    effective = group if group <= MAX_GROUP else next(g for g in range(MAX_GROUP, 7, -8) if group % g == 0)
    padded = -(-K // effective) * effective
    # our group j (effective inputs, wholly inside one of the checkpoint's) takes that group's numbers
    source = torch.arange(padded // effective) * effective // group
    s, z = scales.float()[source].T.contiguous(), zeros[source].T.contiguous()
    q = torch.cat([q.T, q.new_zeros(N, padded - K)], dim=1) if padded != K else q.T
    if bits == 8:
        if not bool((z == 128).all()):
            raise ValueError(f"{name}: 8-bit zero points other than 128 (asymmetric int8) are not supported")
        return QuantizedTensor((q - 128).to(torch.int8).contiguous(), s, None, 8, effective, K, scales.dtype, perm)
    zero = None if bool((z == 8).all()) else ((8 - z).float() * s)
    return QuantizedTensor(q.to(torch.uint8).contiguous(), s, zero, 4, effective, K, scales.dtype, perm)


def concat(parts: list[QuantizedTensor], name: str) -> QuantizedTensor:
    """Weights sharing their input (q, k, v; gate, up) stacked along the outputs, as one fused weight."""
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group, part.super_groups, part.in_features, part.scale_dtype) != (
                first.bits, first.group, first.super_groups, first.in_features, first.scale_dtype):
            raise ValueError(f"{name}: the fused projections are quantised differently")
        if (part.perm is None) != (first.perm is None) or (part.perm is not None and
                                                           not torch.equal(part.perm, first.perm)):
            raise ValueError(f"{name}: the fused projections' act-order g_idx differ")
    if len(parts) == 1:
        return first
    if any((p.zeros is None) != (first.zeros is None) for p in parts) and first.super_groups:
        raise ValueError(f"{name}: the fused projections are quantised differently (mins in some only)")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.scales) for p in parts])
    stacked = {field: torch.cat([p.row_tensors()[field] for p in parts]) for field in first.row_tensors()
               if field != "zeros"}
    return replace(first, **stacked, zeros=zeros)
