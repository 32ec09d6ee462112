"""A decode step's decoder layers in one native call (cpu_decoder.cpp), over the kernels the per-op path runs.

At batch 1 a 0.5B model's decode step spent ~6 of 33 ms between its kernels (Zen 4, bf16): ten Python calls per
layer, each allocating its outputs and checking its inputs. `DecoderStack` checks the layers' tensors once, when
it is built for one set of matmul choices, and then runs all the layers of a step with one call: the same kernels
on the same inputs in the same order as kernels/cpu.py and kernels/fused.py would, so the same bits.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from mini_infer.kernels import cpu, fused, quant

_P, _I = ctypes.c_void_p, ctypes.c_int


class _Matmul(ctypes.Structure):
    _fields_ = [("kernel", _P), ("weight", _P), ("kind", _I), ("w_dtype", _I), ("prefetch", _I), ("perm", _P),
                ("zeros", _I), ("bits", _I), ("group", _I), ("super_groups", _I), ("scale_dtype", _I)]


MAX_QKV_PARTS = 3  # cpu_decoder.cpp's MAX_QKV_PARTS (Layer.qkv_parts)


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv_bias", _P), ("q_norm", _P), ("k_norm", _P),
                ("k_cache", _P), ("v_cache", _P), ("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul),
                ("down", _Matmul), ("qkv_parts", _Matmul * MAX_QKV_PARTS), ("qkv_part_cols", _I * MAX_QKV_PARTS),
                ("num_qkv_parts", _I)]


class _Model(ctypes.Structure):
    _fields_ = [("add_rms_norm", _P), ("rope_kv_write", _P), ("attention", _P), ("silu_mul", _P), ("cos", _P),
                ("sin", _P), ("dtype", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("block_size", _I), ("sum_width", _I), ("num_blocks", ctypes.c_int64),
                ("max_positions", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


# A native matmul path (cpu.MATMUL_PATHS, or quant.QUANT_KERNELS for a quantised weight) and the weight it reads.
NativeLinear = tuple[str, cpu.PackedWeight | quant.QuantPanels]
_QUANT_KIND = 4  # cpu_decoder.cpp's kind for gemm_quant


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """What one decoder layer's decode step reads: its norms' weights, the QKV bias, its K/V caches, each
    projection's matmul (path and packed weight; the QKV projection's may be the matmuls of its differently quantised
    parts, whose outputs are its columns in order) and Qwen3's per-head q and k norms (or None)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qkv: NativeLinear | tuple[NativeLinear, ...]
    o: NativeLinear
    gate_up: NativeLinear
    down: NativeLinear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _parts(linear: NativeLinear | tuple[NativeLinear, ...]) -> tuple[NativeLinear, ...]:
    """A projection's matmuls: its own, or its parts'."""
    return linear if isinstance(linear[0], tuple) else (linear,)


def _address(name: str) -> int:
    return ctypes.cast(cpu.native_function(name), ctypes.c_void_p).value


class DecoderStack:
    """The layers of a model (or pipeline stage) for steps whose every request decodes one token, with one set
    of matmul choices; built once (it checks every tensor it will hand the kernels), run every step."""

    def __init__(self, layers: list[LayerTensors], *, num_heads: int, intermediate_size: int, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
        first = layers[0]
        dtype = first.input_norm.dtype
        num_blocks, block_size, kv_heads, head_dim = first.k_cache.shape
        hidden = first.input_norm.shape[0]
        qkv_size = (num_heads + 2 * kv_heads) * head_dim
        shapes = {"qkv": (qkv_size, hidden), "o": (hidden, num_heads * head_dim),
                  "gate_up": (2 * intermediate_size, hidden), "down": (hidden, intermediate_size)}
        for i, layer in enumerate(layers):
            vectors = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv_bias": (qkv_size,)}
            if (layer.q_norm is None) != (first.q_norm is None) or (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"decoder stack: layer {i} has q/k norms where layer 0 has {first.q_norm is not None}")
            if layer.q_norm is not None:
                vectors.update(q_norm=(head_dim,), k_norm=(head_dim,))
            for name, shape in vectors.items():
                tensor = getattr(layer, name)
                if tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                    raise ValueError(f"decoder stack: layer {i} {name} {tuple(tensor.shape)} {tensor.dtype} must be "
                                     f"a contiguous {dtype} {shape}")
            for cache in (layer.k_cache, layer.v_cache):
                if cache.shape != first.k_cache.shape or cache.dtype != dtype or not cache.is_contiguous():
                    raise ValueError(f"decoder stack: layer {i} cache {tuple(cache.shape)} {cache.dtype} must be a "
                                     f"contiguous {dtype} {tuple(first.k_cache.shape)}")
            for name, shape in shapes.items():
                parts = _parts(getattr(layer, name))
                if name != "qkv" and len(parts) > 1 or len(parts) > MAX_QKV_PARTS:
                    raise ValueError(f"decoder stack: layer {i} {name} has {len(parts)} parts (at most "
                                     f"{MAX_QKV_PARTS if name == 'qkv' else 1})")
                rows = sum(weight.out_features for _, weight in parts)
                if (rows, *{weight.in_features for _, weight in parts}) != shape:
                    raise ValueError(f"decoder stack: layer {i} {name} is {rows} x "
                                     f"{'/'.join(str(weight.in_features) for _, weight in parts)}, not {shape[0]} x "
                                     f"{shape[1]}")
        if (dtype not in cpu.DTYPES or num_heads % kv_heads or head_dim % 2 or cos.dtype != dtype
                or sin.shape != cos.shape or cos.shape[1:] != (head_dim,)):
            raise ValueError(f"decoder stack: {dtype} layers of {num_heads} heads over {kv_heads} KV heads of "
                             f"{head_dim}, cos/sin {tuple(cos.shape)} {cos.dtype}")
        self.dtype, self.hidden, self.block_size, self.num_blocks = dtype, hidden, block_size, num_blocks
        self.max_positions = cos.shape[0]
        self._keep = (layers, cos.contiguous(), sin.contiguous())  # the tensors the structs point into
        self._model = _Model(
            _address("add_rms_norm"), _address("rope_kv_write"),
            _address(cpu.attention_kernel("paged_decode_attention", dtype, dtype, head_dim, layers[0].k_cache.numel())),
            _address("silu_mul"), self._keep[1].data_ptr(), self._keep[2].data_ptr(), cpu.DTYPE_CODES[dtype], hidden,
            num_heads, kv_heads, head_dim, intermediate_size, block_size, fused.sum_width(), num_blocks,
            self.max_positions, eps, 1.0 / math.sqrt(head_dim))
        self._layers = (_Layer * len(layers))(*[self._layer(dtype, layer) for layer in layers])
        self._run = cpu.native_function("decode_layers")

    @classmethod
    def _layer(cls, dtype: torch.dtype, layer: LayerTensors) -> _Layer:
        parts = _parts(layer.qkv)
        matmuls = [cls._matmul(dtype, *parts[0]) if len(parts) == 1 else _Matmul(),
                   *(cls._matmul(dtype, *getattr(layer, name)) for name in ("o", "gate_up", "down"))]
        struct = _Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), layer.qkv_bias.data_ptr(),
                        *(t.data_ptr() if t is not None else None for t in (layer.q_norm, layer.k_norm)),
                        layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), *matmuls)
        if len(parts) > 1:
            struct.num_qkv_parts = len(parts)
            for j, (path, weight) in enumerate(parts):
                struct.qkv_parts[j] = cls._matmul(dtype, path, weight)
                struct.qkv_part_cols[j] = weight.out_features
        return struct

    @staticmethod
    def _matmul(dtype: torch.dtype, path: str, weight: cpu.PackedWeight | quant.QuantPanels) -> _Matmul:
        if isinstance(weight, quant.QuantPanels):
            kernel, prefetch = quant.QUANT_KERNELS[path]
            perm = weight.perm.data_ptr() if weight.perm is not None else None
            return _Matmul(_address(kernel), weight.data.data_ptr(), _QUANT_KIND, 0, prefetch, perm, int(weight.zeros),
                           weight.bits, weight.group, weight.super_groups, quant.SCALE_CODES[weight.scale_dtype])
        kernel = cpu.matmul_kernel(dtype, weight, path)
        prefetch = cpu.MATMUL_PATHS[path].prefetch
        return _Matmul(_address(kernel), weight.data.data_ptr(), cpu.GEMM_KINDS[kernel],
                       cpu.DTYPE_CODES[weight.dtype], 0 if prefetch is None else prefetch)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, hidden] (one decode token per request, where the residual stream starts) through every layer ->
        (the last layer's MLP output, the residual stream before it), as the layers' forward gives them."""
        rows = x.shape[0]
        if (x.shape != (rows, self.hidden) or x.dtype != self.dtype or positions.shape != (rows,)
                or slot_mapping.shape != (rows,) or context_lens.shape != (rows,) or block_tables.dim() != 2
                or block_tables.shape[0] != rows):
            raise ValueError(f"decoder stack: x {tuple(x.shape)} {x.dtype}, positions {tuple(positions.shape)}, slot "
                             f"mapping {tuple(slot_mapping.shape)}, block tables {tuple(block_tables.shape)}, context "
                             f"lens {tuple(context_lens.shape)} for {self.hidden}-wide {self.dtype} rows")
        x = x.contiguous()
        positions, slot_mapping = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
        block_tables = block_tables.to(torch.int64).contiguous()
        context_lens = context_lens.to(torch.int64).contiguous()
        out, residual = torch.empty_like(x), torch.empty_like(x)
        failed = self._run(ctypes.byref(self._model), self._layers, len(self._layers), x.data_ptr(), out.data_ptr(),
                           residual.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                           block_tables.data_ptr(), context_lens.data_ptr(), rows, block_tables.shape[1],
                           torch.get_num_threads())
        if failed == 1:
            raise fused.rope_range_error(slot_mapping, positions, self.num_blocks * self.block_size,
                                         self.max_positions)
        if failed:
            raise cpu.attention_range_error(block_tables, context_lens, self.block_size, self.num_blocks)
        return out, residual
