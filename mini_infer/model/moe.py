"""The mixture-of-experts MLP of Qwen2-MoE and Qwen3-MoE (config.MoeConfig): a router, experts that are SwiGLU MLPs
of their own, and Qwen2-MoE's gated shared expert.

Each step routes every token to its top_k experts, groups the (token, expert) pairs by expert and runs each expert
that has tokens once, on all of its rows: an expert's weights are read once per step however many tokens it has,
and experts without tokens are not read at all. Each expert's projections are linear weights like any other (the
engine's kernels, quantisation and autotuning apply to them). Under tensor parallel each rank holds a slice of
every expert's (and the shared expert's) intermediate dimension and the router whole, so routing is the same on
every rank and one all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer.config import MoeConfig
from mini_infer.model.layers import SwiGLUMLP, empty_parameter
from mini_infer.profiling import profiled


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, intermediate_size: int, shared_intermediate_size: int,
                 linear: Callable, reduce: Callable, activation: Callable, route: Callable, combine: Callable,
                 grouped_linear: Callable | None = None, *, dtype: torch.dtype, device) -> None:
        """intermediate_size / shared_intermediate_size: this rank's slice of each expert's / the shared expert's;
        route(scores, top_k, norm): the router's scores to (weights, order, rows, counts) (Ops.route_experts);
        combine(y, weights, order, top_k, num_tokens): the experts' rows weighted and summed per token
        (Ops.experts_sum); grouped_linear(x, weights, offsets): several experts' matmuls in one call, or None where it
        cannot (Ops.grouped_linear); the experts then run one by one through `linear`."""
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.linear, self.reduce, self.activation = linear, reduce, activation
        self.router, self.combine = route, combine
        self.grouped_linear = grouped_linear
        # The router, kept in the model's dtype (never quantised); a linear weight like the others otherwise (the
        # engine's matmul: at one token on an AMX Xeon, torch's bf16 matmul of it took ~80 us more right after a
        # quantised kernel than alone).
        self.gate = empty_parameter(moe.num_experts, hidden_size, **factory)
        # Each expert a SwiGLU MLP (its weights: the engine's linear weights); the block reduces their partial sums.
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, intermediate_size, linear, _identity, activation,
                                               **factory) for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, linear, _identity, activation,
                                           **factory)
            self.shared_expert_gate = empty_parameter(1, hidden_size, **factory)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """x [T, hidden] -> (weights [T top_k], order, rows, counts) of layers.route_experts: the router's softmax in
        float32 whatever the model's dtype, renormalised over the top_k where the config says so, as the reference
        computes it, and the (token, expert) pairs grouped by expert."""
        return self.router(self.linear(x, self.gate), self.top_k, self.norm_topk_prob)

    def _each(self, x: torch.Tensor, weights: list, offsets: list[int]) -> torch.Tensor:
        """Rows offsets[j] .. offsets[j + 1] of x by weights[j]: in one call where grouped_linear can, else one
        matmul per weight."""
        out = self.grouped_linear(x, weights, offsets) if self.grouped_linear is not None else None
        if out is None:
            out = torch.cat([self.linear(x[a:b], weight) for weight, a, b in zip(weights, offsets, offsets[1:])])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profiled("moe_routing"):
            weights, order, rows, counts = self.route(x)
            ids = [expert for expert, count in enumerate(counts) if count]
            hit = [self.experts[e] for e in ids]
            offsets = [0, *accumulate(counts[e] for e in ids)]
        with profiled("experts"):
            # Each expert with tokens once, on all of its rows, in expert index order; every token's outputs summed
            # in that order (transformers' index_add_ order).
            gate_up = self._each(x[rows], [mlp.gate_up_proj for mlp in hit], offsets)
            y = self._each(self.activation(gate_up), [mlp.down_proj for mlp in hit], offsets)
            out = self.combine(y, weights, order, self.top_k, x.shape[0])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return self.reduce(out)


def swiglu_mlps(mlp: SwiGLUMLP | SparseMoeBlock) -> list[SwiGLUMLP]:
    """A layer's SwiGLU MLPs: the dense one, or a mixture's experts in index order and its shared expert."""
    if isinstance(mlp, SparseMoeBlock):
        return [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]
    return [mlp]
