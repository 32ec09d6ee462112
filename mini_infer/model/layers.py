"""The decoder's building blocks without attention: RMSNorm, rotary embedding (plain or Llama 3.1's scaled
frequencies), the SwiGLU MLP.

Parameters are allocated uninitialised (the loader fills every one of them) in the engine's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import Llama3RopeScaling


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32 (bf16/fp16 lose too much in the mean of squares).
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute_dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form) from a cos/sin table over every position.

    The table is computed in float32 and cast to the model dtype, as the reference implementation does.
    """

    def __init__(self, head_dim: int, rope_theta: float, max_positions: int, *, dtype: torch.dtype, device,
                 scaling: Llama3RopeScaling | None = None, freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            inv_freq = _llama3_frequencies(inv_freq, scaling)
        if freq_factors is not None:  # llama.cpp's form of the same scaling (a GGUF file's rope_freqs)
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T] absolute positions."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies: a wavelength beyond original_max_position_embeddings / low_freq_factor is
    stretched by `factor`, one below original / high_freq_factor kept; between the two the frequency moves from the
    stretched to the kept one linearly in original / wavelength (float32, as the reference computes them)."""
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    return torch.where(wavelength > original / scaling.low_freq_factor, inv_freq / scaling.factor,
                       torch.where(wavelength < original / scaling.high_freq_factor, inv_freq, blended))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul and `activation` the silu-and-multiply
    (torch's by default). Under tensor parallel each rank holds a slice of the intermediate dimension and `reduce`
    sums the ranks' partial outputs."""

    def __init__(self, hidden_size: int, intermediate_size: int, linear: Callable, reduce: Callable,
                 activation: Callable | None = None, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.linear, self.reduce, self.activation = linear, reduce, activation or silu_and_mul
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_parameter(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.linear(self.activation(self.linear(x, self.gate_up_proj)), self.down_proj))


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in torch's kernels, written into `out` when given (the same matmul: mm, or addmm with a bias)."""
    if out is None:
        return F.linear(x, weight, bias)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def route_experts(scores: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         list[int]]:
    """A mixture's routing from the router's scores [T, E]: each token's top_k experts by the softmax in float32
    (renormalised over the top_k where `norm`), as the reference computes it, and the (token, expert) pairs grouped
    by expert, in token order within each (a stable sort). Returns (weights [T top_k] in the scores' dtype, entry
    t top_k + j the token's j-th; order [T top_k]: the pair indices t top_k + j expert by expert; rows: the token of
    each; counts: each expert's number of pairs). Sorted in Python: a decode step's few pairs took ~0.2 ms a layer
    through argsort and unique_consecutive right after the experts' matmuls had streamed their weights through the
    caches (the Qwen3-30B-A3B shape at one token on an AMX Xeon)."""
    probs = scores.softmax(dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.flatten().tolist()
    order = torch.tensor(sorted(range(len(flat)), key=flat.__getitem__), dtype=torch.int64, device=scores.device)
    counts = [0] * scores.shape[1]
    for expert in flat:
        counts[expert] += 1
    return weights.to(scores.dtype).flatten(), order, order // top_k, counts


def experts_sum(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
                num_tokens: int) -> torch.Tensor:
    """A mixture's output per token [num_tokens, H]: row p of y [P, H] is entry order[p] of the [num_tokens, top_k]
    routing (token order[p] // top_k, routing weight weights[order[p]] of the flattened weights), each token's
    weighted rows added in y's order (transformers' index_add_ order; in bfloat16, torch's index_add_ sums in
    float32 and rounds once)."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    return out.index_add_(0, order // top_k, y * weights[order, None])
