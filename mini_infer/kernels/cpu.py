"""mini-infer's native CPU kernels (OpenMP): matmuls for AVX2 + FMA, AVX-512F, AVX512_BF16 and AMX, paged decode
attention; and the shared-memory all-reduce of tensor-parallel ranks on one machine.

torch's CPU matmul in bfloat16 is only fast where the CPU has native bf16 instructions (AVX512-BF16, AMX);
elsewhere it runs near 18 GFLOP/s. The AVX2 and AVX-512F kernels widen bf16 to float32 in registers instead, so
they read each weight byte once and compute at the float32 FMA rate; the AVX512_BF16 one multiplies bf16 pairs
with `vdpbf16ps`, the AMX one 16 x 32 by 32 x 16 tiles of them per instruction (Intel Xeons from Sapphire Rapids
on, which Linux lets a process use once it asks). kernels/autotune.py times them against torch's per weight shape and
batch size, and the model runs the fastest.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from mini_infer import machine
from mini_infer.kernels.build import KernelUnavailable, build_library, compiler_version

_BASE_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
_AVX2 = [*_BASE_FLAGS, "-mavx2", "-mfma"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl"]
_FUSED = [*_AVX2, "-ffp-contract=off"]  # a * b + c must round twice, as torch's two ops do
DTYPES = (torch.bfloat16, torch.float32)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype arguments
PANEL = 16  # output columns per panel of a packed weight (cpu_gemm*.cpp)
_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
# gemm_quant(x, x_dtype, perm, panels, zeros, scale_dtype, bits, group, super_groups, bias, bias_dtype, out, out_dtype,
# M, N, K, prefetch, threads)
_QUANT_ARGS = [_P, _I, _P, _P] + [_I] * 5 + [_P, _I, _P] + [_I] * 6
# gemm_quant_grouped(x, x_dtype, panels (pointers), zeros, scale_dtype, bits, group, super_groups, out, out_dtype,
# offsets, count, N, K, prefetch, threads)
_GROUPED_ARGS = [_P, _I, _P] + [_I] * 5 + [_P, _I, _P] + [_I] * 5


@dataclass(frozen=True, slots=True)
class _Kernel:
    source: str
    function: str
    argtypes: list
    restype: type | None
    flags: list[str]
    needs: tuple[str, ...]  # /proc/cpuinfo flags the build's instructions need
    enable: str | None = None  # a function of the library that must return 0 (the OS's permission) before it runs


_AVX512_BF16_NEEDS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_KERNELS = {
    "gemm": _Kernel("cpu_gemm.cpp", "gemm", [_P, _I] * 4 + [_I] * 4, None, _AVX2, ("avx2", "fma")),
    "gemm_avx512": _Kernel("cpu_gemm_avx512.cpp", "gemm_avx512", [_P, _I, _P, _P, _I, _P] + [_I] * 6, None,
                           [*_AVX512, "-DGEMM_BF16=0"], ("avx2", "fma", "avx512f", "avx512bw", "avx512vl")),
    "gemm_avx512_pairs": _Kernel("cpu_gemm_avx512.cpp", "gemm_avx512_pairs", [_P, _I, _P, _P, _I, _P] + [_I] * 6,
                                 None, [*_AVX512, "-DGEMM_BF16=0"], ("avx2", "fma", "avx512f", "avx512bw", "avx512vl")),
    "gemm_avx512bf16": _Kernel("cpu_gemm_avx512.cpp", "gemm_avx512bf16", [_P, _P, _P, _I, _P] + [_I] * 6, None,
                               [*_AVX512, "-mavx512bf16", "-DGEMM_BF16=1"],
                               ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
    "gemm_amx": _Kernel("cpu_gemm_amx.cpp", "gemm_amx", [_P, _P, _P, _I, _P] + [_I] * 5, None,
                        [*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
                        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"),
                        enable="amx_enable"),
    "paged_decode_attention": _Kernel("cpu_attention.cpp", "paged_decode_attention",
                                      [_P] * 6 + [_I] * 8 + [ctypes.c_int64, _F, _I], _I, _AVX2, ("avx2", "fma")),
    "paged_prefill_attention": _Kernel("cpu_attention.cpp", "paged_prefill_attention",
                                       [_P] * 5 + [_I] * 8 + [ctypes.c_int64, _F, _I], _I, _AVX2, ("avx2", "fma")),
    # The same two for bfloat16 models where the CPU has AVX512_BF16 (the source's second build; attention_kernel).
    "paged_decode_attention_bf16": _Kernel("cpu_attention.cpp", "paged_decode_attention_bf16",
                                           [_P] * 6 + [_I] * 8 + [ctypes.c_int64, _F, _I], _I,
                                           [*_AVX512, "-mavx512bf16"], _AVX512_BF16_NEEDS),
    "paged_prefill_attention_bf16": _Kernel("cpu_attention.cpp", "paged_prefill_attention_bf16",
                                            [_P] * 5 + [_I] * 8 + [ctypes.c_int64, _F, _I], _I,
                                            [*_AVX512, "-mavx512bf16"], _AVX512_BF16_NEEDS),
    # kernels/fused.py: a decoder layer's elementwise steps, one library.
    "add_rms_norm": _Kernel("cpu_fused.cpp", "add_rms_norm", [_P] * 5 + [_I] * 3 + [_F, _I, _I], None, _FUSED,
                            ("avx2", "fma")),
    "silu_mul": _Kernel("cpu_fused.cpp", "silu_mul", [_P] * 2 + [_I] * 4, None, _FUSED, ("avx2", "fma")),
    "rms_norm_heads": _Kernel("cpu_fused.cpp", "rms_norm_heads", [_P] * 3 + [_I] * 5 + [_F, _I, _I], None, _FUSED,
                              ("avx2", "fma")),
    "rope_kv_write": _Kernel("cpu_fused.cpp", "rope_kv_write", [_P] * 8 + [_I] * 5 + [ctypes.c_int64] * 2 + [_I], _I,
                             _FUSED, ("avx2", "fma")),
    "argmax_rows": _Kernel("cpu_fused.cpp", "argmax_rows", [_P, _I, _I, _I, ctypes.c_int64, _P, _I], None, _FUSED,
                           ("avx2", "fma")),
    "top_k_rows": _Kernel("cpu_fused.cpp", "top_k_rows", [_P, _I, _I, _I, ctypes.c_int64, _P, _I, _P, _P, _I, _P, _P,
                                                          _I], _I, _FUSED, ("avx2", "fma")),
    "mask_rows": _Kernel("cpu_fused.cpp", "mask_rows", [_P, ctypes.c_int64, _I, _P, _I, _P, _I, _I], None, _FUSED,
                         ("avx2", "fma")),
    "moe_combine": _Kernel("cpu_fused.cpp", "moe_combine", [_P, _P, _P, _P] + [_I] * 6, _I, _FUSED, ("avx2", "fma")),
    "moe_route": _Kernel("cpu_fused.cpp", "moe_route", [_P] + [_I] * 5 + [_P] * 4 + [_I], _I, _FUSED, ("avx2", "fma")),
    # kernels/decoder.py: a decode step's layers in one call, through the kernels above (their addresses passed in).
    "decode_layers": _Kernel("cpu_decoder.cpp", "decode_layers", [_P, _P, _I] + [_P] * 7 + [_I] * 3, _I, _BASE_FLAGS,
                             ()),
    # kernels/autotune.py: a weight's cache lines flushed before a timed decode-sized call (CLFLUSHOPT where the CPU
    # has it, else CLFLUSH).
    "flush_lines_opt": _Kernel("cpu_cache.cpp", "flush_lines", [_P, ctypes.c_int64], None,
                               [*_BASE_FLAGS, "-mclflushopt", "-DCLFLUSHOPT=1"], ("clflushopt",)),
    "flush_lines": _Kernel("cpu_cache.cpp", "flush_lines", [_P, ctypes.c_int64], None,
                           [*_BASE_FLAGS, "-DCLFLUSHOPT=0"], ("sse2",)),
    "shm_allreduce": _Kernel("shm_allreduce.cpp", "shm_allreduce", [_P, _I, _I, _L, ctypes.c_int64, _P, _I, _L], _L,
                             _AVX2, ("avx2", "fma")),
}
# kernels/quant.py: weights quantised to int8, int6 or int4, products of int16 x and the integers in registers; four
# builds of one source (AVX2, AVX-512BW, AVX512_VNNI, and AMX: bf16 x and the integers as bf16 in tiles), each with
# the matmul and the grouped matmul (several weights, each on its rows of x, in one call).
_VNNI_NEEDS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_QUANT_BUILDS = {
    "": ([*_AVX2, "-mf16c", "-DQUANT_AVX512=0"], ("avx2", "fma", "f16c"), None),  # F16C: two-level scales' float16
    "_avx512": ([*_AVX512, "-DQUANT_AVX512=1", "-DQUANT_VNNI=0"], ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
                None),
    "_vnni": ([*_AVX512, "-mavx512vnni", "-DQUANT_AVX512=1", "-DQUANT_VNNI=1"], _VNNI_NEEDS, None),
    # bfloat16 x only: the weights' integers widened to bf16 and multiplied by AMX tiles (TDPBF16PS).
    "_amx": ([*_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-DQUANT_AVX512=1",
              "-DQUANT_VNNI=1", "-DQUANT_AMX=1"], (*_VNNI_NEEDS, "avx512_bf16", "amx_tile", "amx_bf16"), "amx_enable"),
}
for _suffix, (_flags, _needs, _enable) in _QUANT_BUILDS.items():
    _KERNELS[f"gemm_quant{_suffix}"] = _Kernel("cpu_gemm_quant.cpp", "gemm_quant", _QUANT_ARGS, _I, _flags, _needs,
                                               _enable)
    _KERNELS[f"gemm_quant_grouped{_suffix}"] = _Kernel("cpu_gemm_quant.cpp", "gemm_quant_grouped", _GROUPED_ARGS, _I,
                                                       _flags, _needs, _enable)
# The kernels that must build for cpu_kernels to run natively; the AVX-512 matmuls are extra paths where the CPU
# has them (MATMUL_PATHS), and the OPTIONAL ones each take over one job where they build (torch's, or the per-op path,
# does it where they do not; Ops' note says which are missing).
REQUIRED = ("gemm", "paged_decode_attention", "paged_prefill_attention", "add_rms_norm", "silu_mul", "rope_kv_write")
OPTIONAL = ("argmax_rows", "top_k_rows", "mask_rows", "decode_layers", "shm_allreduce", "paged_decode_attention_bf16",
            "paged_prefill_attention_bf16", "moe_combine", "moe_route", "rms_norm_heads")


@dataclass(frozen=True, slots=True)
class MatmulPath:
    kernels: dict[torch.dtype, tuple[str, str]]  # weight dtype -> (the layout the path reads, its kernel)
    prefetch: int | None  # the AVX-512 kernels' weight prefetch: NEAR or FAR (cpu_gemm_avx512.cpp); avx2, amx: none
    # Paths of one arithmetic give the same numbers bit for bit, whatever the row count: each output is its row's
    # products summed in k order into one float32 accumulator (fma32: the AVX2 and AVX-512F kernels), or by bf16
    # pairs (dpbf16), or by AMX tiles; prefetching changes no number. Deterministic mode keeps one per weight shape.
    arithmetic: str


NEAR, FAR = 0, 1
# AVX-512F reads bf16 weights in pairs (one shift or mask widens 16 of them; 12-24 % faster than panels at 8-64 rows
# on an AVX-512 Xeon, and the same sums in the same order), so that avx512 and avx512_bf16 share one copy of a bf16
# weight.
_AVX512 = {torch.float32: ("panels", "gemm_avx512"), torch.bfloat16: ("pairs", "gemm_avx512_pairs")}
_AVX512_BF16 = {torch.bfloat16: ("pairs", "gemm_avx512bf16")}
# Native matmul paths. Each AVX-512 kernel runs as two paths that differ only in how far ahead and into which cache
# level the weight streams are prefetched (NEAR: L1, 64 k steps, tuned on an AVX-512 Xeon; FAR: L2, 512, faster at
# 1-32 rows on a Zen 4 EPYC, where NEAR streamed slower than no prefetch): the CPU decides, so the autotuner times both.
MATMUL_PATHS = {
    "avx2": MatmulPath({torch.float32: ("panels", "gemm"), torch.bfloat16: ("panels", "gemm")}, None, "fma32"),
    "avx512": MatmulPath(_AVX512, NEAR, "fma32"),
    "avx512/far": MatmulPath(_AVX512, FAR, "fma32"),
    "avx512_bf16": MatmulPath(_AVX512_BF16, NEAR, "dpbf16"),
    "avx512_bf16/far": MatmulPath(_AVX512_BF16, FAR, "dpbf16"),
    "amx_bf16": MatmulPath({torch.bfloat16: ("pairs", "gemm_amx")}, None, "amx"),
}


def weight_layout(path: str, dtype: torch.dtype) -> str:
    """The layout a `dtype` weight is packed in for matmul path `path`."""
    return MATMUL_PATHS[path].kernels[dtype][0]


# What the sources include (part of each build's cache key).
_HEADERS = ("bf16.h", "exp8.h", "avx512.h", "amx.h", "panel_runs.h")
# Per kernel name: its function, or why it cannot run (the message only: a stored exception would keep the frames of
# its traceback alive, and with them whatever they held, a whole engine's weights and KV cache among them).
_outcomes: dict[str, Callable | str] = {}


def native_function(name: str):
    """The named kernel of _KERNELS, built on first use; KernelUnavailable says why it cannot run here (the outcome
    is kept: a kernel that failed to build is not built again on every lookup)."""
    if name not in _outcomes:
        try:
            _outcomes[name] = _load(_KERNELS[name])
        except KernelUnavailable as e:
            _outcomes[name] = str(e)
    outcome = _outcomes[name]
    if isinstance(outcome, str):
        raise KernelUnavailable(outcome)
    return outcome


def _load(kernel: _Kernel):
    missing = [flag for flag in kernel.needs if flag not in machine.cpu().flags]
    if missing:
        raise KernelUnavailable(f"the CPU lacks {', '.join(missing)} (needed by {kernel.function})")
    here = Path(__file__).parent
    library = build_library(here / kernel.source, kernel.flags, headers=tuple(here / name for name in _HEADERS))
    if kernel.enable is not None:
        refused = getattr(library, kernel.enable)()
        if refused:
            raise KernelUnavailable(f"the OS refused {kernel.function} its registers ({kernel.enable}: "
                                    f"{errno.errorcode.get(refused, refused)})")
    function = getattr(library, kernel.function)
    function.argtypes, function.restype = kernel.argtypes, kernel.restype
    return function


def prebuild(names) -> None:
    """Build the libraries of the named kernels that this CPU can run, several compilers at once (one per core): a
    first run's builds take about half the time on two cores. Failures are left for native_function to report."""
    libraries = {}
    for name in names:
        kernel = _KERNELS[name]
        if name not in _outcomes and all(flag in machine.cpu().flags for flag in kernel.needs):
            libraries.setdefault((kernel.source, tuple(kernel.flags)), kernel)
    here = Path(__file__).parent

    def build(kernel: _Kernel) -> None:
        try:
            build_library(here / kernel.source, kernel.flags, headers=tuple(here / name for name in _HEADERS))
        except KernelUnavailable:
            pass  # native_function builds it again and keeps the reason
    if len(libraries) > 1:
        with ThreadPoolExecutor(max_workers=machine.usable_cores()) as pool:
            list(pool.map(build, libraries.values()))


def kernel_reason(name: str) -> str | None:
    """None where the named kernel runs here, else why not."""
    try:
        native_function(name)
    except KernelUnavailable as e:
        return str(e)
    return None


def build_key(*kernels: str) -> str:
    """Everything the named kernels' code depends on: their sources with the headers, their flags and the compiler
    (a change re-times the autotuner's choices)."""
    here = Path(__file__).parent
    specs = [_KERNELS[name] for name in sorted(set(kernels))]  # in a fixed order: the key must not vary by process
    sources = sorted({spec.source for spec in specs} | set(_HEADERS))
    flags = [" ".join(spec.flags) for spec in specs]
    return "\0".join([*((here / name).read_text() for name in sources), *flags, compiler_version()])


def gemm_source() -> str:
    """The float matmul kernels' build key (build_key)."""
    return build_key(*{kernel for path in MATMUL_PATHS.values() for _, kernel in path.kernels.values()})


def unavailable_reason() -> str | None:
    """None when every required kernel builds and loads here, else why not."""
    for name in REQUIRED:
        reason = kernel_reason(name)
        if reason is not None:
            return reason
    return None


def missing_optional() -> dict[str, str]:
    """The optional kernels that do not run here, each with why."""
    return {name: reason for name in OPTIONAL if (reason := kernel_reason(name)) is not None}


def matmul_paths(dtype: torch.dtype) -> dict[str, str | None]:
    """Each native matmul path for a model of `dtype`: None where it runs here, else why not (AVX512_BF16
    multiplies bf16 only)."""
    paths = {}
    for path, spec in MATMUL_PATHS.items():
        kernels = spec.kernels
        if dtype not in kernels:
            paths[path] = "bf16 products only (the model is float32)"
            continue
        try:
            native_function(kernels[dtype][1])
            paths[path] = None
        except KernelUnavailable as e:
            paths[path] = str(e)
    return paths


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight [N, K] laid out for a native matmul: `panels` of 16 output columns, [ceil(N/16), K, 16]
    (the AVX2 kernel, and AVX-512F's on float32 weights), or `pairs`, [ceil(N/16), ceil(K/2), 16, 2] bfloat16
    (AVX512_BF16, and AVX-512F's on bf16 weights)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    layout: str = "panels"

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]


def pack_weight(weight: torch.Tensor, layout: str = "panels") -> PackedWeight:
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
        raise ValueError(f"cpu linear packs 2-d CPU bfloat16/float32 weights, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if layout not in ("panels", "pairs") or (layout == "pairs" and weight.dtype != torch.bfloat16):
        raise ValueError(f"layout must be 'panels', or 'pairs' for a bfloat16 weight; got {layout!r} for "
                         f"{weight.dtype}")
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    if layout == "panels":
        padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - out_features))
        data = padded.view(panels, PANEL, in_features).transpose(1, 2)
    else:
        pairs = -(-in_features // 2)
        padded = torch.nn.functional.pad(weight, (0, 2 * pairs - in_features, 0, panels * PANEL - out_features))
        data = padded.view(panels, PANEL, pairs, 2).transpose(1, 2)
    return PackedWeight(data.contiguous(), out_features, in_features, layout)


# How each matmul kernel takes its arguments (cpu_gemm*.cpp; cpu_decoder.cpp calls them by these kinds too):
# AVX2 reads a weight of either dtype; the AVX-512 ones take a prefetch; AVX512_BF16's and AMX's x is bfloat16 only.
GEMM_KINDS = {"gemm": 0, "gemm_avx512": 1, "gemm_avx512_pairs": 1, "gemm_avx512bf16": 2, "gemm_amx": 3}
_AVX2_KIND, _BF16_KIND, _AMX_KIND = 0, 2, 3
_BF16_X_KINDS = (_BF16_KIND, _AMX_KIND)  # the kernels that take bfloat16 x only


def matmul_kernel(x_dtype: torch.dtype, weight: PackedWeight, path: str) -> str:
    """The kernel of native path `path` that multiplies `x_dtype` rows by `weight` (ValueError if it cannot)."""
    spec = MATMUL_PATHS.get(path)
    layout, kernel = spec.kernels.get(weight.dtype, ("", "")) if spec is not None else ("", "")
    if (x_dtype not in DTYPES or layout != weight.layout
            or (GEMM_KINDS.get(kernel) in _BF16_X_KINDS and x_dtype != torch.bfloat16)):
        raise ValueError(f"cpu linear: x of {x_dtype} on path {path!r} does not match a {weight.layout} {weight.dtype} "
                         f"weight of {weight.out_features} x {weight.in_features}")
    return kernel


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
           path: str = "avx2", out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T + bias -> [M, N] in x's dtype (float32 or bfloat16) through a native path (its weight
    in that path's layout); arithmetic in float32, or bf16 products summed in float32 on `avx512_bf16`. Written into
    `out` when given (output_buffer: a caller's reused [M, N] tensor)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"cpu linear: x {tuple(x.shape)} does not match a {weight.layout} {weight.dtype} weight of "
                         f"{weight.out_features} x {weight.in_features}")
    kernel = matmul_kernel(x.dtype, weight, path)
    kind = GEMM_KINDS[kernel]
    x = x.contiguous()
    out = output_buffer(out, x.shape[0], weight.out_features, x.dtype, "cpu linear")
    bias_args = (bias.contiguous().data_ptr(), DTYPE_CODES[bias.dtype]) if bias is not None else (None, 0)
    sizes = (x.shape[0], weight.out_features, x.shape[1])
    prefetch = () if kind in (_AVX2_KIND, _AMX_KIND) else (MATMUL_PATHS[path].prefetch,)
    x_args = (x.data_ptr(),) if kind in _BF16_X_KINDS else (x.data_ptr(), DTYPE_CODES[x.dtype])
    w_args = (weight.data.data_ptr(), DTYPE_CODES[weight.dtype]) if kind == _AVX2_KIND else (weight.data.data_ptr(),)
    native_function(kernel)(*x_args, *w_args, *bias_args, out.data_ptr(), DTYPE_CODES[x.dtype], *sizes, *prefetch,
                            torch.get_num_threads())
    return out


def output_buffer(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A native kernel's [rows, cols] output: `out` where the caller passes one (checked: a kernel writes through
    its pointer), else a new tensor."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype)
    if out.shape != (rows, cols) or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"{what}: out {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: "
                         f"{out.is_contiguous()}) is not a contiguous CPU [{rows}, {cols}] {dtype} tensor")
    return out


def caches_fit(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a kernel can index the key and value caches as one layout: the same shape and dtype, contiguous."""
    return (v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def describe_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """The caches' shapes, dtypes and contiguity, for an error message."""
    return (f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} {k_cache.dtype} / {v_cache.dtype} (contiguous: "
            f"{k_cache.is_contiguous()}, {v_cache.is_contiguous()})")


@functools.cache
def attention_kernel(kind: str, q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, cache_numel: int) -> str:
    """The kernel that runs `kind` ("paged_decode_attention" or "paged_prefill_attention") for these tensors: the
    AVX512_BF16 build for bfloat16 q and caches, heads a multiple of 32 wide, where the CPU runs it (and the decode
    kernel's 32-bit gather offsets reach every cache element), else the float32-arithmetic kernel."""
    fast = f"{kind}_bf16"
    if (q_dtype == cache_dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 512
            and cache_numel // 2 < 2 ** 31 and kernel_reason(fast) is None):
        return fast
    return kind


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [R, H, D], one query per request, over the first context_lens[r] cached tokens -> [R, H, D]."""
    num_reqs, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_head_dim = k_cache.shape
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or heads % kv_heads:
        raise ValueError(f"cpu attention: q {q.dtype} with {heads} heads, cache {k_cache.dtype} with {kv_heads}")
    # The kernel indexes raw memory: anything out of shape or range would read outside the caches.
    if (not caches_fit(k_cache, v_cache) or cache_head_dim != head_dim or block_tables.shape[0] != num_reqs
            or context_lens.shape != (num_reqs,)):
        raise ValueError(f"cpu attention: {describe_caches(k_cache, v_cache)}, q {tuple(q.shape)}, block tables "
                         f"{tuple(block_tables.shape)}, context lens {tuple(context_lens.shape)}")
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    # The kernel checks the context lengths and block ids before it reads anything (1: out of range).
    if native_function(attention_kernel("paged_decode_attention", q.dtype, k_cache.dtype, head_dim,
                                     k_cache.numel()))(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), DTYPE_CODES[q.dtype], DTYPE_CODES[k_cache.dtype], num_reqs, heads, kv_heads, head_dim,
            block_size, block_tables.shape[1], num_blocks, 1.0 / math.sqrt(head_dim), torch.get_num_threads()):
        raise attention_range_error(block_tables, context_lens, block_size, num_blocks)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            blocks: torch.Tensor, context_len: int) -> torch.Tensor:
    """One request's prefill: q [Lq, H, D], its new tokens at positions context_len - Lq .., each attending causally
    over the cached keys up to its own position, read through `blocks` (its block-table row) -> [Lq, H, D]."""
    num_tokens, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_head_dim = k_cache.shape
    if (q.dtype not in DTYPES or k_cache.dtype not in DTYPES or heads % kv_heads or cache_head_dim != head_dim
            or not caches_fit(k_cache, v_cache) or blocks.dim() != 1 or blocks.shape[0] * block_size < context_len):
        raise ValueError(f"cpu prefill attention: q {tuple(q.shape)} {q.dtype}, {describe_caches(k_cache, v_cache)}, "
                         f"{blocks.shape[0]} blocks of {block_size} for a context of {context_len}")
    q = q.contiguous()
    blocks = blocks.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    # The kernel checks the query count and the block ids the context needs before it reads anything (1: refused).
    if native_function(attention_kernel("paged_prefill_attention", q.dtype, k_cache.dtype, head_dim,
                                     k_cache.numel()))(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), out.data_ptr(),
            DTYPE_CODES[q.dtype], DTYPE_CODES[k_cache.dtype], num_tokens, context_len, heads, kv_heads, head_dim,
            block_size, num_blocks, 1.0 / math.sqrt(head_dim), torch.get_num_threads()):
        needed = blocks[: -(-context_len // block_size)]
        raise ValueError(f"cpu prefill attention: {num_tokens} query tokens (must be in [1, {context_len}]), block "
                         f"ids in [{int(needed.min())}, {int(needed.max())}] (must be in [0, {num_blocks - 1}])")
    return out


def span(values: torch.Tensor) -> str:
    """`[lowest, highest]` of a tensor's values, for an error message."""
    lowest, highest = (int(v) for v in torch.aminmax(values))
    return f"[{lowest}, {highest}]"


def attention_range_error(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                          num_blocks: int) -> ValueError:
    """What the attention kernel refused (it returned 1): the ranges it found and the ones it allows."""
    return ValueError(f"cpu attention: context lengths in {span(context_lens)} (must be in [1, "
                      f"{block_tables.shape[1] * block_size}]), block ids in {span(block_tables)} (must be in [0, "
                      f"{num_blocks - 1}])")


def flush_caches(tensors: list[torch.Tensor]) -> None:
    """Write back and evict the tensors' memory from every cache level (CLFLUSHOPT where the CPU has it)."""
    flush = native_function("flush_lines_opt" if kernel_reason("flush_lines_opt") is None else "flush_lines")
    for t in tensors:
        flush(t.data_ptr(), t.numel() * t.element_size())


_SHM_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}


def shm_allreduce(segment: torch.Tensor, rank: int, world: int, slot_bytes: int, first_seq: int,
                  x: torch.Tensor) -> int:
    """Sum x (contiguous, in place) over the ranks sharing `segment` (shm_allreduce.cpp); returns the rounds used."""
    if x.dtype not in _SHM_CODES or not x.is_contiguous():
        raise ValueError(f"shm all-reduce takes contiguous float32/bfloat16/float64 tensors, got {x.dtype}")
    return native_function("shm_allreduce")(segment.data_ptr(), rank, world, slot_bytes, first_seq, x.data_ptr(),
                                          _SHM_CODES[x.dtype], x.numel())
