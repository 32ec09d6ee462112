"""Weight-only quantisation of linear weights: int8 and int4, group-wise along the input features.

- int8: symmetric, w = q * scale per group of GROUP_SIZE["int8"] inputs, q in [-127, 127].
- int4: symmetric, w = (q - 8) * scale per group of GROUP_SIZE["int4"] inputs, q in [0, 15], by llama.cpp's Q4_0 rule
  (scale = the group's largest |w|, signed, / -8), torch's int4 form with zero points 0, so its
  `_weight_int4pack_mm_for_cpu` computes the same weights. Pre-quantised checkpoints (model/prequantized.py) add int4
  with a zero point per group, w = (q - 8) * scale + zero.
- two-level (llama.cpp's K-quants, read from GGUF files: model/gguf_weights.py): int8 scales sc (and mins m) per group,
  under float16 ones d (and dmin) per super-block of `super_groups` groups, w = q * d * sc - dmin * m; q int8 (Q5_K's
  0..31), 0..15 in int4 (Q4_K, with mins) or int6 (Q6_K's q - 32, -32..31, held in int8, packed in 6 bits). The
  kernel reads the two levels as they are (docs/decisions/027-k-quant-layout.md).

A weight is quantised once into a `QuantizedTensor` (the integers and per-group scales, row-major), from which each
matmul that can run it takes its own packed copy: mini-infer's kernel (cpu_gemm_quant.cpp, AVX2 or AVX-512: x rounded
to int16 per group, the weights widened in registers, exact integer sums per group; AMX: a bf16 x as it is, the
weights widened to bf16 tiles, float32 sums per group) reads `QuantPanels`; torch's int4 matmul reads `TorchInt4Pack`.
Scales and zeros are rounded to the model's dtype where it is bfloat16 or float16 (stored as bfloat16 for a bf16
model, 2 bytes per group and column), so that every candidate, torch's included, multiplies the same numbers.
"""

from __future__ import annotations

import ctypes

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_infer.config import QUANTIZATION_METHODS
from mini_infer.kernels import cpu
from mini_infer.kernels.build import KernelUnavailable

# Inputs per scale. 32 as llama.cpp's Q8_0 / Q4_0 blocks: per output channel (int8) or groups of 128 (int4) gave
# a larger mean KL divergence from the bf16 model than llama.cpp's formats of the same bits
# (docs/decisions/002-int4-q4_0-rule.md).
# int4 is symmetric (Q4_0's integers for a bf16 checkpoint, 4.5 bits a weight): with a zero point per group too (5
# bits) its KL was 21 % lower, but the top-1 token matched the bf16 model's at 27 % of positions against 32 % by
# Q4_0's rule, on the random 0.5B model, whose top-1 tokens are few (two of them 27 % of the positions), so that
# one coherent shift flips many.
GROUP_SIZE = {"int8": 32, "int4": 32}
# The LM head's method: int4 models keep it in int8, as llama.cpp's Q4_0 mix keeps its output tensor at 6-8 bits
# (with the head in int4 too, the top-1 token differed from the bf16 model's at 75 % of positions;
# docs/decisions/003-int8-lm-head-for-int4.md).
# Only where the native kernels run (torch has no int8 group matmul).
HEAD_METHOD = {"int8": "int8", "int4": "int8"}
PANEL = 16  # output columns per panel (cpu_gemm_quant.cpp)


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a quantised weight's numbers are laid out, all that its matmuls' speed depends on besides its shape."""

    bits: int  # 8 (int8, symmetric) or 4
    group: int  # inputs per scale
    zeros: bool  # int4 with a zero point per group (else (q - 8) * scale); two-level: with mins
    scale_dtype: torch.dtype  # the dtype whose values the scales and zeros hold (two-level: float16, d's and dmin's)
    super_groups: int = 0  # groups per super-block of two-level scales, or 0 (one level)

    @property
    def name(self) -> str:
        if self.super_groups:
            mins = " with mins" if self.zeros else ""
            return f"int{self.bits} g{self.group}{mins}, int8 scales under float16 ones per {self.super_groups} groups"
        zeros = " with zero points" if self.zeros else ""
        return f"int{self.bits} g{self.group}{zeros}, {str(self.scale_dtype).removeprefix('torch.')} scales"


def method_scheme(method: str, dtype: torch.dtype) -> Scheme:
    """The scheme a float weight of a `dtype` model is quantised to by `method` (QUANTIZATION_METHODS)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    return Scheme(8 if method == "int8" else 4, GROUP_SIZE[method], False, scale_dtype(dtype))


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A quantised [N, K] weight, row-major: q [N, Kp] (int8 for int8; uint8 holding 0..15 for int4), scales and
    zeros (int4 only, or None: 0) float32 [N, Kp / group]; Kp is K rounded up to a multiple of the group, the
    padding's q (and so its weight) zero. With `perm` (int64 [K]; a GPTQ checkpoint's act-order groups), column j
    holds input feature perm[j]: the matmul reads x[:, perm].

    Two-level (super_groups > 0): scales and zeros are int8 [N, Kp / group], sc and the mins m (or None), under
    super_scales and super_mins float16 [N, Kp / (group * super_groups)], d and dmin; Kp is K rounded up to whole
    super-blocks; w = q * d * sc - dmin * m."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int
    in_features: int
    scale_dtype: torch.dtype  # the dtype whose values the scales and zeros hold (bf16, fp16 or fp32)
    perm: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None
    super_groups: int = 0

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.bits, self.group, self.zeros is not None, self.scale_dtype, self.super_groups)

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors with a row per output feature, by field name (for dataclasses.replace)."""
        fields = {"q": self.q, "scales": self.scales, "zeros": self.zeros, "super_scales": self.super_scales,
                  "super_mins": self.super_mins}
        return {name: t for name, t in fields.items() if t is not None}

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for: q * scale, or (q - 8) * scale + zero, or two-level
        q * d * sc - dmin * m (columns in input order)."""
        if self.super_groups:
            def per_k(sub: torch.Tensor, top: torch.Tensor) -> torch.Tensor:  # d * sc per column k, float32 (exact)
                return (top.float().repeat_interleave(self.super_groups, dim=1) * sub.float()).repeat_interleave(
                    self.group, dim=1)

            weight = self.q.float() * per_k(self.scales, self.super_scales)
            if self.zeros is not None:
                weight = weight - per_k(self.zeros, self.super_mins)
            return weight[:, : self.in_features]
        scales = self.scales.repeat_interleave(self.group, dim=1)
        if self.bits == 8:
            weight = self.q.float() * scales
        else:
            zeros = self.zeros.repeat_interleave(self.group, dim=1) if self.zeros is not None else 0.0
            weight = (self.q.float() - 8) * scales + zeros
        weight = weight[:, : self.in_features]
        if self.perm is None:
            return weight
        unpermuted = torch.empty_like(weight)
        unpermuted[:, self.perm] = weight
        return unpermuted


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a model of `dtype` keeps its scales (and zeros) in: its own where that is bf16 or fp16 (torch's int4
    matmul multiplies them in the activations' dtype), else float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def kernel_source(scheme: Scheme) -> str:
    """What the autotuner's timings of `scheme` weights depend on besides the machine: the kernels' build key (their
    source with its headers, flags and compiler), the scheme."""
    return f"{cpu.build_key(*dict.fromkeys(kernel for kernel, _ in QUANT_KERNELS.values()))}\0{scheme.name}"


def quantize(weight: torch.Tensor, method: str | Scheme, scale_dtype: torch.dtype) -> QuantizedTensor:
    """Quantise a 2-d float weight by `method` (QUANTIZATION_METHODS, its scales (and zeros) rounded to `scale_dtype`;
    or a Scheme: its bits, group, zero points and scale dtype, `scale_dtype` then unused)."""
    scheme = method if isinstance(method, Scheme) else method_scheme(method, scale_dtype)
    scale_dtype = scheme.scale_dtype
    if scheme.super_groups:
        mins_allowed = {4: scheme.zeros, 6: not scheme.zeros, 8: True}  # int4 needs mins, int6 takes none
        if scheme.scale_dtype != torch.float16 or not mins_allowed.get(scheme.bits, False):
            raise ValueError(f"quantize: no two-level scheme {scheme.name} with {scheme.scale_dtype} scales")
    elif scheme.bits not in (4, 8) or (scheme.bits == 8 and scheme.zeros):
        raise ValueError(f"quantize: no int{scheme.bits} scheme{' with zero points' if scheme.zeros else ''}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes a 2-d float weight, got {tuple(weight.shape)} {weight.dtype}")
    group = scheme.group
    out_features, in_features = weight.shape
    unit = group * max(scheme.super_groups, 1)
    padded = -(-in_features // unit) * unit
    w = F.pad(weight.float(), (0, padded - in_features)).view(out_features, padded // group, group)
    if scheme.super_groups:
        return _two_level(w, scheme, in_features)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(scale_dtype).float()

    if scheme.bits == 8:
        scales = rounded(w.abs().amax(dim=-1) / 127)
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedTensor(q.view(out_features, padded), scales, None, 8, group, in_features, scale_dtype)
    if not scheme.zeros:  # symmetric int4, llama.cpp's Q4_0 rule: the group's largest |w| is q = 0 exactly
        largest = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))[..., 0]  # signed
        scales = rounded(largest / -8)
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.floor(w / safe[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)
        return QuantizedTensor(q.view(out_features, padded), scales, None, 4, group, in_features, scale_dtype)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = rounded((high - low) / 15)
    zeros = rounded(low + 8 * scales)  # q = 0 at the group's minimum
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round((w - zeros[..., None]) / safe[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensor(q.view(out_features, padded), scales, zeros, 4, group, in_features, scale_dtype)


def _two_level(w: torch.Tensor, scheme: Scheme, in_features: int) -> QuantizedTensor:
    """w [N, groups, group] in two levels: each group's scale s (and min mn >= 0, the part of its range below 0)
    split into d * sc, with d one float16 per super-block sized so that sc <= 127 and sc rounded up (d * sc >= s, so
    that q stays in range); mins as dmin * m, m rounded to nearest. q: int8 in [-127, 127] without mins, [0, 127]
    with; int4 (mins required) [0, 15]; int6 (no mins) [-31, 31]."""
    rows, groups, _ = w.shape
    supers, top = groups // scheme.super_groups, {4: 15, 6: 31, 8: 127}[scheme.bits]

    def split(values: torch.Tensor, up: bool) -> tuple[torch.Tensor, torch.Tensor]:  # [N, groups] -> (d, int8)
        by_super = values.view(rows, supers, scheme.super_groups)
        d = (by_super.amax(dim=-1) / (126 if up else 127)).to(torch.float16)  # one below 127: room for rounding up
        safe = torch.where(d == 0, torch.ones_like(d), d).float()[..., None]
        ratio = by_super / safe
        sub = (torch.ceil(ratio) if up else torch.round(ratio)).clamp_(0, 127).to(torch.int8)
        return d, sub.view(rows, groups)

    if scheme.zeros:
        mins = (-w.amin(dim=-1)).clamp_(min=0)
        dmin, m = split(mins, up=False)
        mins = (dmin.float().repeat_interleave(scheme.super_groups, dim=1) * m.float())[..., None]
        d, sc = split((w.amax(dim=-1) + mins[..., 0]).clamp_(min=0) / top, up=True)
    else:
        mins, dmin, m = 0.0, None, None
        d, sc = split(w.abs().amax(dim=-1) / top, up=True)
    scales = (d.float().repeat_interleave(scheme.super_groups, dim=1) * sc.float())[..., None]
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round((w + mins) / safe).clamp_(0 if scheme.zeros else -top, top)
    q = q.to(torch.uint8 if scheme.bits == 4 else torch.int8).view(rows, -1)
    return QuantizedTensor(q, sc, m, scheme.bits, scheme.group, in_features, torch.float16, None, d, dmin,
                           scheme.super_groups)


def random_quantized(scheme: Scheme, out_features: int, in_features: int,
                     generator: torch.Generator | None = None) -> QuantizedTensor:
    """A QuantizedTensor of `scheme` with random integers and scales (the autotuner's timing data: a kernel's speed
    does not depend on the values), made without a float weight: an LM head's [151936, 2048] is 1.2 GB in float32,
    several times that while quantise works, its integers 0.3 GB."""
    unit = scheme.group * max(scheme.super_groups, 1)
    padded = -(-in_features // unit) * unit
    groups = padded // scheme.group
    low, high, kind = {4: (0, 16, torch.uint8), 6: (-32, 32, torch.int8), 8: (-127, 128, torch.int8)}[scheme.bits]
    if scheme.bits == 8 and scheme.super_groups and scheme.zeros:
        low = 0  # (as _two_level's: int8 q under mins is 0..127)
    q = torch.randint(low, high, (out_features, padded), dtype=kind, generator=generator)
    if scheme.super_groups:
        supers = groups // scheme.super_groups

        def level(count: int) -> tuple[torch.Tensor, torch.Tensor]:  # int8 sub-scales, float16 ones over them
            sub = torch.randint(1, 64, (out_features, groups), dtype=torch.int8, generator=generator)
            return sub, (torch.rand(out_features, count, generator=generator) * 1e-3).to(torch.float16)

        sc, d = level(supers)
        m, dmin = level(supers) if scheme.zeros else (None, None)
        return QuantizedTensor(q, sc, m, scheme.bits, scheme.group, in_features, torch.float16, None, d, dmin,
                               scheme.super_groups)
    scales = (torch.rand(out_features, groups, generator=generator) * 1e-2).to(scheme.scale_dtype).float()
    zeros = (torch.rand(out_features, groups, generator=generator) * 1e-2).to(scheme.scale_dtype).float() \
        if scheme.zeros else None
    return QuantizedTensor(q, scales, zeros, scheme.bits, scheme.group, in_features, scheme.scale_dtype)


@dataclass(frozen=True, slots=True)
class StackedParts:
    """A fused weight (q, k, v; gate, up) whose parts are quantised differently (a GGUF Q4_K_M file's Q4_K q and k
    beside a Q6_K v): each part its own matmul, their outputs side by side."""

    parts: tuple[QuantizedTensor, ...]


@dataclass(frozen=True, slots=True)
class QuantPanels:
    """A QuantizedTensor in cpu_gemm_quant.cpp's layout: panels of 16 output columns, each one run of bytes (a row
    of `data`, uint8 [P, panel bytes]): its scales [Kp / group, 16] (bfloat16 where they hold bf16 values, else
    float32), its zeros likewise (int4 with zero points), zero-padded to a multiple of 64 bytes, then its q in steps
    of 4 bytes per column holding 4 k (int8, in the order k, k + 2, k + 1, k + 3) or 8 k (int4, k + d in nibble d / 2
    for even d and 4 + d / 2 for odd d), [Kp / 4 or Kp / 8, 16, 4] bytes (int6: steps of 8 k, q + 32's low nibbles
    as int4's then its high bits, [Kp / 8, 96] bytes); perm int32 [K] as QuantizedTensor's, or None. Two-level: d,
    dmin (float16, [Kp / (group * super_groups), 16] each), sc, m (int8, [Kp / group, 16]) in the head instead."""

    data: torch.Tensor
    scale_dtype: torch.dtype  # the scales' and zeros' storage: bfloat16 or float32 (two-level: float16, d's)
    zeros: bool
    bits: int
    group: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None
    super_groups: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.perm) if t is not None]


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C, ...] -> [ceil(N / 16), C, 16, ...], columns past N zero."""
    rows, cols, rest = t.shape[0], t.shape[1], t.shape[2:]
    panels = -(-rows // PANEL)
    padded = torch.cat([t, t.new_zeros(panels * PANEL - rows, cols, *rest)])
    return padded.view(panels, PANEL, cols, *rest).transpose(1, 2).contiguous()


_INT8_ORDER = [0, 2, 1, 3]  # byte b of a column's step holds k + _INT8_ORDER[b]
_INT4_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # k + d goes to nibble _INT4_NIBBLE[d]


def _int4_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[N, steps, 8] uint8 values 0..15 -> [N, steps, 4] bytes: each step's 32-bit word (little-endian), k + d in
    nibble _INT4_NIBBLE[d], so byte b holds nibbles 2b and 2b + 1. In uint8 throughout: an LM head's temporaries
    stay the size of its integers."""
    d_of = [_INT4_NIBBLE.index(n) for n in range(8)]  # the k + d in nibble n
    return torch.stack([nibbles[..., d_of[2 * b]] | (nibbles[..., d_of[2 * b + 1]] << 4) for b in range(4)], dim=-1)


def pack_panels(qt: QuantizedTensor) -> QuantPanels:
    rows, padded = qt.q.shape
    if qt.bits == 8:
        q = _panels(qt.q.view(rows, padded // 4, 4)[:, :, _INT8_ORDER].contiguous().view(torch.uint8))
    elif qt.bits == 4:
        q = _panels(_int4_words(qt.q.view(rows, padded // 8, 8)))
    else:  # int6: q + 32's low nibbles as int4's, then its high 2 bits, 2 bytes a column (k + d's at bit 2 (d // 2) of
        # byte d % 2: the 16-bit lane holding d's nibble), each step's 64 + 32 bytes together
        u = (qt.q.view(torch.uint8) + 32).view(rows, padded // 8, 8)  # (wraps: -32..31 -> 0..63)
        high = u >> 4
        pairs = torch.stack([high[..., p] | (high[..., p + 2] << 2) | (high[..., p + 4] << 4) | (high[..., p + 6] << 6)
                             for p in (0, 1)], dim=-1)
        low_panels, high_panels = _panels(_int4_words(u & 15)), _panels(pairs)
        q = torch.cat([low_panels.flatten(2), high_panels.flatten(2)], dim=2)
    if qt.super_groups:
        stored = torch.float16
        parts = [qt.super_scales, qt.super_mins, qt.scales, qt.zeros]  # float16 d, dmin, then int8 sc, m
    else:
        stored = torch.bfloat16 if qt.scale_dtype == torch.bfloat16 else torch.float32
        parts = [t.to(stored) for t in (qt.scales, qt.zeros) if t is not None]
    head = [_panels(t.contiguous()).view(q.shape[0], -1).view(torch.uint8) for t in parts if t is not None]
    head.append(q.new_zeros(q.shape[0], -sum(t.shape[1] for t in head) % 64))
    data = torch.cat([*head, q.view(q.shape[0], -1)], dim=1)
    perm = qt.perm.to(torch.int32).contiguous() if qt.perm is not None else None
    return QuantPanels(data, stored, qt.zeros is not None, qt.bits, qt.group, qt.out_features, qt.in_features, perm,
                       qt.super_groups)


@dataclass(frozen=True, slots=True)
class TorchInt4Pack:
    """A QuantizedTensor (int4) for torch's `_weight_int4pack_mm_for_cpu`, which needs N a multiple of 16 (the
    rows past N are zero) and K a multiple of the group (x is padded with zeros where it is not); its scales and
    zeros are in x's dtype."""

    data: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None  # as QuantizedTensor's

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scales_and_zeros, self.perm) if t is not None]


def torch_int4_available(scheme: Scheme, dtype: torch.dtype) -> str | None:
    """None where torch's int4 matmul computes exactly the weights of `scheme` for `dtype` activations, else why not."""
    if scheme.bits != 4:
        return "torch has no CPU matmul for group-wise int8 weights (_weight_int8pack_mm scales per channel only)"
    if scheme.super_groups:
        return "torch's int4 matmul takes one level of scales, not int8 ones under float16 ones"
    if scheme.group not in (32, 64, 128, 256):
        return f"torch's int4 matmul takes groups of 32, 64, 128 or 256, not {scheme.group}"
    exact = scheme.scale_dtype == dtype or dtype == torch.float32  # bf16 and fp16 values are float32 ones
    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or not exact:
        return (f"torch's int4 matmul holds scales in the activations' dtype ({dtype}), which would round these "
                f"{scheme.scale_dtype} ones")
    return None


def pack_torch_int4(qt: QuantizedTensor, dtype: torch.dtype) -> TorchInt4Pack:
    reason = torch_int4_available(qt.scheme, dtype)
    if reason is not None:
        raise ValueError(reason)
    rows = -(-qt.out_features // PANEL) * PANEL
    q = F.pad(qt.q.to(torch.int32), (0, 0, 0, rows - qt.out_features), value=8)  # padding rows: weight 0
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    zeros = qt.zeros if qt.zeros is not None else torch.zeros_like(qt.scales)
    pairs = torch.stack([qt.scales, zeros], dim=-1)  # [N, groups, 2]
    pairs = F.pad(pairs, (0, 0, 0, 0, 0, rows - qt.out_features)).transpose(0, 1).contiguous().to(dtype)
    return TorchInt4Pack(data, pairs, qt.group, qt.out_features, qt.in_features, qt.perm)


def torch_int4_linear(x: torch.Tensor, weight: TorchInt4Pack, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    padded = weight.data.shape[1] * 2
    if x.shape[-1] != padded:
        x = F.pad(x, (0, padded - x.shape[-1]))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight.data, weight.group,
                                                     weight.scales_and_zeros)
    if weight.data.shape[0] != weight.out_features:
        out = out[:, : weight.out_features].contiguous()
    return out if bias is None else out + bias


# --- the native kernel -----------------------------------------------------------------------------------------

# The native paths for quantised weights, named as the float ones (kernels/cpu.py): the AVX2, AVX-512BW and
# AVX512_VNNI builds, each with the weight stream prefetched NEAR (into L1) or FAR (into L2), and the AMX build
# (bfloat16 activations only: it multiplies x as it is, in bf16 tiles).
SCALE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' scale_dtype argument
QUANT_KERNELS = {"avx2": ("gemm_quant", 0), "avx2/far": ("gemm_quant", 1), "avx512": ("gemm_quant_avx512", 0),
                 "avx512/far": ("gemm_quant_avx512", 1), "avx512_vnni": ("gemm_quant_vnni", 0),
                 "avx512_vnni/far": ("gemm_quant_vnni", 1), "amx_bf16": ("gemm_quant_amx", 0)}
BF16_ONLY = frozenset({"amx_bf16"})  # paths whose kernel refuses float32 activations


def quant_paths(dtype: torch.dtype = torch.bfloat16) -> dict[str, str | None]:
    """Each native path for quantised weights under `dtype` activations: None where it runs here, else why not."""
    paths = {}
    for path, (kernel, _) in QUANT_KERNELS.items():
        if path in BF16_ONLY and dtype != torch.bfloat16:
            paths[path] = f"it multiplies bfloat16 activations only, not {dtype}"
            continue
        try:
            cpu.native_function(kernel)
            paths[path] = None
        except KernelUnavailable as e:
            paths[path] = str(e)
    return paths


def _check_activations(x: torch.Tensor, path: str) -> None:
    if path in BF16_ONLY and x.dtype != torch.bfloat16:
        raise ValueError(f"quantised linear: the {path} path multiplies bfloat16 activations only, not {x.dtype}")


def quant_linear(x: torch.Tensor, weight: QuantPanels, bias: torch.Tensor | None = None,
                 path: str = "avx2", out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ the dequantised weight.T + bias -> [M, N] in x's dtype, float32 sums (into
    `out` when given, as cpu.linear)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype not in cpu.DTYPE_CODES or path not in QUANT_KERNELS:
        raise ValueError(f"quantised linear: x {tuple(x.shape)} {x.dtype} on path {path!r} does not match an int"
                         f"{weight.bits} weight of {weight.out_features} x {weight.in_features}")
    _check_activations(x, path)
    kernel, prefetch = QUANT_KERNELS[path]
    x = x.contiguous()
    out = cpu.output_buffer(out, x.shape[0], weight.out_features, x.dtype, "quantised linear")
    bias_args = (bias.contiguous().data_ptr(), cpu.DTYPE_CODES[bias.dtype]) if bias is not None else (None, 0)
    perm = weight.perm.data_ptr() if weight.perm is not None else None
    if cpu.native_function(kernel)(x.data_ptr(), cpu.DTYPE_CODES[x.dtype], perm, weight.data.data_ptr(),
                                   int(weight.zeros), SCALE_CODES[weight.scale_dtype], weight.bits, weight.group,
                                   weight.super_groups, *bias_args, out.data_ptr(), cpu.DTYPE_CODES[x.dtype],
                                   x.shape[0], weight.out_features, x.shape[1], prefetch, torch.get_num_threads()):
        raise ValueError(f"quantised linear: the kernel refused bits {weight.bits}, group {weight.group}")
    return out


def quant_linear_grouped(x: torch.Tensor, weights: list[QuantPanels], offsets: list[int],
                         path: str = "avx2") -> torch.Tensor:
    """Rows offsets[j] .. offsets[j + 1] of x [M, K] (float32 or bfloat16) @ weights[j]'s dequantised weight.T, every
    j in one call: out [M, N] in x's dtype, each row as quant_linear computes it. The weights share one shape and
    format and have no act-order permutation (a mixture of experts' experts)."""
    first = weights[0]
    if (x.dim() != 2 or x.shape[1] != first.in_features or x.dtype not in cpu.DTYPE_CODES or path not in QUANT_KERNELS
            or len(offsets) != len(weights) + 1 or offsets[-1] != x.shape[0]
            or any((w.bits, w.group, w.super_groups, w.zeros, w.scale_dtype, w.out_features, w.in_features, w.perm)
                   != (first.bits, first.group, first.super_groups, first.zeros, first.scale_dtype, first.out_features,
                       first.in_features, None)
                for w in weights)):
        raise ValueError(f"grouped quantised linear: x {tuple(x.shape)} {x.dtype} on path {path!r} with offsets "
                         f"{offsets} does not match {len(weights)} weights like int{first.bits} "
                         f"{first.out_features} x {first.in_features} without a permutation")
    _check_activations(x, path)
    kernel, prefetch = QUANT_KERNELS[path]
    x = x.contiguous()
    out = torch.empty(x.shape[0], first.out_features, dtype=x.dtype)
    panels = (ctypes.c_void_p * len(weights))(*(w.data.data_ptr() for w in weights))
    starts = (ctypes.c_int32 * len(offsets))(*offsets)
    grouped = cpu.native_function(f"gemm_quant_grouped{kernel.removeprefix('gemm_quant')}")  # the same build's
    if grouped(x.data_ptr(), cpu.DTYPE_CODES[x.dtype], panels, int(first.zeros), SCALE_CODES[first.scale_dtype],
               first.bits, first.group, first.super_groups, out.data_ptr(), cpu.DTYPE_CODES[x.dtype], starts,
               len(weights), first.out_features, x.shape[1], prefetch, torch.get_num_threads()):
        raise ValueError(f"grouped quantised linear: the kernel refused bits {first.bits}, group {first.group}")
    return out
