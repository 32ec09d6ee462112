"""mini-infer's native CPU kernels (AVX2 + FMA, OpenMP): matmuls and paged decode attention; and the shared-memory
all-reduce of tensor-parallel ranks on one machine.

torch's CPU matmul in bfloat16 is only fast where the CPU has native bf16 instructions (AVX512-BF16, AMX);
elsewhere it runs near 18 GFLOP/s. These kernels widen bf16 to float32 in registers instead, so they read each
weight byte once and compute at the float32 FMA rate; at decode sizes they also beat MKL in float32. Where
torch's is faster, kernels/autotune.py finds out and the model runs torch's instead.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mini_infer.kernels.build import KernelUnavailable, build_library

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17"]
DTYPES = (torch.bfloat16, torch.float32)
_CODES = {torch.float32: 0, torch.bfloat16: 1}
PANEL = 16  # output columns per panel of a packed weight (cpu_gemm.cpp)
_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
_SIGNATURES = {  # source file -> (function, argument types, result type)
    "cpu_gemm.cpp": ("gemm", [_P, _I] * 4 + [_I] * 4, None),
    "cpu_attention.cpp": ("paged_decode_attention", [_P] * 6 + [_I] * 8 + [_F, _I], None),
    "shm_allreduce.cpp": ("shm_allreduce", [_P, _I, _I, _L, ctypes.c_int64, _P, _I, _L], _L),
}


@functools.cache
def _function(source: str):
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelUnavailable(f"the CPU lacks AVX2 + FMA (torch reports {capability})")
    name, argtypes, restype = _SIGNATURES[source]
    here = Path(__file__).parent
    function = getattr(build_library(here / source, FLAGS, headers=(here / "bf16.h",)), name)
    function.argtypes, function.restype = argtypes, restype
    return function


def gemm_source() -> str:
    """The matmul kernel's source (a changed kernel re-times the autotuner's choices)."""
    here = Path(__file__).parent
    return (here / "cpu_gemm.cpp").read_text() + (here / "bf16.h").read_text()


def unavailable_reason() -> str | None:
    """None when every kernel builds and loads here, else why not."""
    try:
        for source in _SIGNATURES:
            _function(source)
    except KernelUnavailable as e:
        return str(e)
    return None


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight [N, K] laid out for the matmul kernel: panels of 16 output columns, [ceil(N/16), K, 16]."""

    data: torch.Tensor
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
        raise ValueError(f"cpu linear packs 2-d CPU bfloat16/float32 weights, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - out_features))
    return PackedWeight(padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous(), out_features)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T + bias -> [M, N] in x's dtype (float32 or bfloat16); arithmetic in float32."""
    if x.dim() != 2 or x.shape[1] != weight.data.shape[1] or x.dtype not in DTYPES:
        raise ValueError(f"cpu linear: x {tuple(x.shape)} {x.dtype} does not match a weight of "
                         f"{weight.out_features} x {weight.data.shape[1]}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    bias_args = (bias.contiguous().data_ptr(), _CODES[bias.dtype]) if bias is not None else (None, 0)
    _function("cpu_gemm.cpp")(x.data_ptr(), _CODES[x.dtype], weight.data.data_ptr(), _CODES[weight.dtype],
                              *bias_args, out.data_ptr(), _CODES[x.dtype], x.shape[0], weight.out_features,
                              x.shape[1], torch.get_num_threads())
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [R, H, D], one query per request, over the first context_lens[r] cached tokens -> [R, H, D]."""
    num_reqs, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_head_dim = k_cache.shape
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or heads % kv_heads:
        raise ValueError(f"cpu attention: q {q.dtype} with {heads} heads, cache {k_cache.dtype} with {kv_heads}")
    # The kernel indexes raw memory: anything out of shape or range would read outside the caches.
    if (v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or cache_head_dim != head_dim
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or block_tables.shape[0] != num_reqs or context_lens.shape != (num_reqs,)):
        raise ValueError(f"cpu attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} (contiguous: "
                         f"{k_cache.is_contiguous()}, {v_cache.is_contiguous()}), q {tuple(q.shape)}, block tables "
                         f"{tuple(block_tables.shape)}, context lens {tuple(context_lens.shape)}")
    if num_reqs:
        shortest, longest = (int(v) for v in torch.aminmax(context_lens))
        lowest, highest = (int(v) for v in torch.aminmax(block_tables))
        if shortest < 1 or longest > block_tables.shape[1] * block_size or lowest < 0 or highest >= num_blocks:
            raise ValueError(f"cpu attention: context lengths in [{shortest}, {longest}] (must be in [1, "
                             f"{block_tables.shape[1] * block_size}]), block ids in [{lowest}, {highest}] (must be "
                             f"in [0, {num_blocks - 1}])")
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    _function("cpu_attention.cpp")(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), _CODES[q.dtype], _CODES[k_cache.dtype], num_reqs, heads, kv_heads, head_dim, block_size,
        block_tables.shape[1], 1.0 / math.sqrt(head_dim), torch.get_num_threads())
    return out


_SHM_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}


def shm_allreduce(segment: torch.Tensor, rank: int, world: int, slot_bytes: int, first_seq: int,
                  x: torch.Tensor) -> int:
    """Sum x (contiguous, in place) over the ranks sharing `segment` (shm_allreduce.cpp); returns the rounds used."""
    if x.dtype not in _SHM_CODES or not x.is_contiguous():
        raise ValueError(f"shm all-reduce takes contiguous float32/bfloat16/float64 tensors, got {x.dtype}")
    return _function("shm_allreduce.cpp")(segment.data_ptr(), rank, world, slot_bytes, first_seq, x.data_ptr(),
                                          _SHM_CODES[x.dtype], x.numel())
