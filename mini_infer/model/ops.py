"""The model's kernels: torch ops, or mini-infer's native CPU kernels for the matmuls and decode attention.

`cpu_kernels="auto"` takes the native kernels on the CPU for bfloat16 and float32 models, and for each linear
weight shape and batch-size bucket the fastest of the native matmul paths this CPU runs (AVX2, AVX-512F,
AVX512_BF16, AMX) and torch's (kernels/autotune.py): a weight is kept in the forms its winners read (packed
panels, bf16 pairs, as it is for torch; a tied LM head's packed copies are its own). `on` runs the best native
path everywhere (AMX for bf16, then AVX512_BF16, then AVX-512F, then AVX2). If the kernels cannot be built,
`auto` says so once and runs torch ops; `on` raises instead; `off` always runs torch ops.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mini_infer import machine
from mini_infer.config import CPU_KERNEL_MODES, QUANTIZATION_METHODS, EngineConfig
from mini_infer.kernels import cpu, fused, quant
from mini_infer.kernels.autotune import BUCKETS, LinearTuner, bucket_index, machine_key, timed_ms
from mini_infer.model.attention import AttentionMetadata, paged_attention, write_kv
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, experts_sum, route_experts, silu_and_mul, torch_linear
from mini_infer.profiling import profiled

if TYPE_CHECKING:
    from mini_infer.model.triton_ops import TritonOps


@dataclass(frozen=True, slots=True)
class TunedWeight:
    """A linear weight in the forms its timed choices need: packed per native layout, as it is for torch; or, quantised,
    in the native kernel's panels ("quant") and torch's int4 form ("int4pack")."""

    packed: dict[str, cpu.PackedWeight | quant.QuantPanels | quant.TorchInt4Pack]  # layout -> packed weight
    dense: torch.Tensor | None
    winners: tuple[str, ...]  # per autotune bucket: a native path (cpu.MATMUL_PATHS, quant.QUANT_KERNELS) or "torch"

    def tensors(self) -> list[torch.Tensor]:
        packed = [t for p in self.packed.values() for t in p.tensors()]
        return packed + ([self.dense] if self.dense is not None else [])

    def native(self, path: str) -> cpu.PackedWeight | quant.QuantPanels:
        """The packed weight that native path `path` reads."""
        if "quant" in self.packed:
            return self.packed["quant"]
        dtype = self.dense.dtype if self.dense is not None else next(iter(self.packed.values())).dtype
        return self.packed[cpu.weight_layout(path, dtype)]


# The most of the memory available at load that torch's second copies of the weights may take (Ops._float_winners).
DENSE_COPY_SHARE = 0.5


def native_only(winners: tuple[str, ...]) -> tuple[str, ...]:
    """Per bucket, the winner where it is native, else the nearest native bucket's (the smaller one on a tie);
    all-torch winners stay as they are (torch's is then the only copy)."""
    native = [i for i, winner in enumerate(winners) if winner != "torch"]
    if not native:
        return winners
    return tuple(winners[min(native, key=lambda n: (abs(n - i), n))] for i in range(len(winners)))


@dataclass(frozen=True, slots=True)
class Ops:
    native: bool  # the native CPU kernels run
    note: str  # why, for logs and benchmark reports
    tuner: LinearTuner | None = None  # float weights' with the native kernels: None runs `path` everywhere
    path: str = "avx2"  # the native matmul path for float weights without a tuner
    # The linear weights quantised at load (config.QUANTIZATION_METHODS), or the method a pre-quantised checkpoint's
    # were quantised by (config.CHECKPOINT_QUANTIZATION).
    quantization: str | None = None
    quant_path: str = "avx2"  # the native path for quantised weights without a tuner
    quant_timer: Callable[[quant.Scheme], LinearTuner] | None = None  # each scheme's tuner (with a float tuner)
    quant_tuners: dict[quant.Scheme, LinearTuner] = field(default_factory=dict)  # made on first use
    chosen: dict[str, list[str]] = field(default_factory=dict)  # per weight prepared (shape, scheme): its winners
    dtype: torch.dtype = torch.float32  # the model's (its activations')
    graph_safe: bool = False  # CUDA graphs are the GPU backend's (model/triton_ops.py)
    optional: frozenset[str] = frozenset()  # the optional native kernels that run here (cpu.OPTIONAL)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | cpu.PackedWeight | TunedWeight | tuple[TunedWeight, ...],
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias, into `out` where given (the runner's reused logits buffer: on the CPU a fresh
        [rows, vocab] tensor costs its page faults every step)."""
        if isinstance(weight, tuple):  # a fused weight of differently quantised parts (quant.StackedParts)
            if out is not None:
                raise ValueError("linear: out is for a single weight, not a fused weight of quantised parts")
            stacked = torch.cat([self.linear(x, part) for part in weight], dim=-1)
            return stacked if bias is None else stacked + bias
        native = self.native_linear(weight, x.shape[0])
        if native is not None:
            path, packed = native
            if isinstance(packed, quant.QuantPanels):
                return quant.quant_linear(x, packed, bias, path, out)
            return cpu.linear(x, packed, bias, path, out)
        if isinstance(weight, TunedWeight) and "int4pack" in weight.packed:
            result = quant.torch_int4_linear(x, weight.packed["int4pack"], bias)
            return result if out is None else out.copy_(result)
        return torch_linear(x, weight.dense if isinstance(weight, TunedWeight) else weight, bias, out)

    def native_linear(self, weight: torch.Tensor | cpu.PackedWeight | TunedWeight,
                      rows: int) -> tuple[str, cpu.PackedWeight | quant.QuantPanels] | None:
        """The native path and packed weight that a matmul of `rows` rows by `weight` runs on, or None where
        torch's does."""
        if isinstance(weight, TunedWeight):
            path = weight.winners[bucket_index(rows)]
            return None if path == "torch" else (path, weight.native(path))
        return (self.path, weight) if isinstance(weight, cpu.PackedWeight) else None  # (parts: several matmuls)

    def grouped_linear(self, x: torch.Tensor, weights: list[TunedWeight], offsets: list[int]) -> torch.Tensor | None:
        """Rows offsets[j] .. offsets[j + 1] of x by weights[j] (weights of one shape: a mixture's experts), in one
        native call (quant.quant_linear_grouped) where they are quantised without an act-order permutation and the
        autotuner's winner at the largest group's rows is native; None elsewhere (the caller runs them one by
        one). Each row comes out as linear() computes it on that path."""
        first = weights[0]
        if not isinstance(first, TunedWeight) or "quant" not in first.packed:
            return None
        path = first.winners[bucket_index(max(b - a for a, b in zip(offsets, offsets[1:])))]
        panels = [weight.packed["quant"] for weight in weights]
        if path == "torch" or panels[0].perm is not None:
            return None
        return quant.quant_linear_grouped(x, panels, offsets, path)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        if not self.native:
            return paged_attention(q, k_cache, v_cache, meta)
        return paged_attention(q, k_cache, v_cache, meta, cpu.paged_decode_attention, cpu.paged_prefill_attention)

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual: the residual stream's add
        done by the norm after it, in one pass with the native kernels."""
        if not self.native:
            x = x if residual is None else x + residual
            return norm(x), x
        if residual is None:
            return fused.rms_norm(x, norm.weight, norm.eps), x
        return fused.add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up) if self.native else silu_and_mul(gate_up)

    def experts_sum(self, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
                    num_tokens: int) -> torch.Tensor:
        """A mixture's weighted sum of its experts' rows per token (layers.experts_sum), in one native pass for
        bfloat16/float32 where the kernel runs."""
        if self.runs("moe_combine") and y.dtype in cpu.DTYPES:
            return fused.moe_combine(y, weights, order, top_k, num_tokens)
        return experts_sum(y, weights, order, top_k, num_tokens)

    def route_experts(self, scores: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, list[int]]:
        """A mixture's routing and grouping (layers.route_experts), in one native pass for bfloat16/float32 where
        the kernel runs."""
        if self.runs("moe_route") and scores.dtype in cpu.DTYPES:
            return fused.moe_route(scores, top_k, norm)
        return route_experts(scores, top_k, norm)

    def runs(self, kernel: str) -> bool:
        """Whether the optional native kernel `kernel` (cpu.OPTIONAL) does its job here."""
        return self.native and kernel in self.optional

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1) of logits [R, V] (greedy decoding); natively in one threaded pass for bf16/float32."""
        return fused.argmax(x) if self.runs("argmax_rows") and x.dtype in cpu.DTYPES else x.argmax(dim=-1)

    @property
    def top_k(self):
        """The sampler's top-k over the logits (fused.top_k: each row's k largest after its sparse edits, in one pass)
        where the native kernel runs, whose logits are then bfloat16 or float32; None elsewhere (the sampler then
        works on a copy of the logits with torch)."""
        return fused.top_k if self.runs("top_k_rows") else None

    @property
    def mask_rows(self):
        """The sampler's structured-output bitmask over float32 logits (fused.mask_rows) where the native kernel
        runs; None elsewhere (the sampler then unpacks the bits with torch)."""
        return fused.mask_rows if self.runs("mask_rows") else None

    def rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, num_heads: int,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) D] -> q [T, heads, D] rotated; k rotated and v stored at their cache slots
        (with the native kernels in one pass, which the profile's kv_write range then covers). Qwen3's q_norm and
        k_norm, where given, normalise each head of q and k first (in place in qkv)."""
        k_cache, v_cache = kv_cache
        if q_norm is not None:
            self._norm_heads(qkv, q_norm, k_norm, num_heads, k_cache.shape[3])
        if self.native:
            with profiled("kv_write"):
                return fused.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping,
                                           num_heads)
        num_tokens, (kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
        q, k, v = qkv.split((num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        q, k = rotary(positions, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, kv_heads, head_dim))
        with profiled("kv_write"):
            write_kv(k_cache, v_cache, k, v.view(num_tokens, kv_heads, head_dim), slot_mapping)
        return q

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, head_dim: int) -> None:
        """q_norm over each query head and k_norm over each key head of qkv [T, q + 2 kv], in place (natively in one
        call where the kernel runs)."""
        q_size, kv_size = num_heads * head_dim, (qkv.shape[1] - num_heads * head_dim) // 2
        if self.runs("rms_norm_heads") and qkv.dtype in cpu.DTYPES and qkv.is_contiguous():
            fused.rms_norm_heads(qkv, q_norm.weight, k_norm.weight, num_heads, kv_size // head_dim, q_norm.eps)
            return
        for norm, part in ((q_norm, slice(0, q_size)), (k_norm, slice(q_size, q_size + kv_size))):
            heads = qkv[:, part].reshape(-1, head_dim)
            qkv[:, part] = self.rms_norm(norm, heads)[0].view(qkv.shape[0], -1)

    def prepare(self, linear_weights: list[tuple[nn.Module, str]]) -> None:
        """Swap each named linear weight for the forms its matmuls run on: packed for the native kernels where they
        run; quantised first where the engine quantises; a pre-quantised checkpoint's (already a QuantizedTensor)
        packed as it is. Weights prepared already (the GGUF loader prepares each as it is read) are left as they are."""
        if not self.native and self.quantization is None:
            return
        linear_weights = [(module, name) for module, name in linear_weights if not _prepared(getattr(module, name))]
        float_winners = self._float_winners(linear_weights)
        for module, name in linear_weights:
            weight = getattr(module, name)
            module._parameters.pop(name, None)  # a tied head keeps the embedding registered under its own name
            method = self._method(name) if not isinstance(weight, quant.QuantizedTensor) else None
            if method is not None:
                weight = quant.quantize(weight.data, method, quant.scale_dtype(weight.dtype))
            if isinstance(weight, quant.StackedParts):
                setattr(module, name, tuple(self._packed_quantized(part, name) for part in weight.parts))
                continue
            if isinstance(weight, quant.QuantizedTensor):
                setattr(module, name, self._packed_quantized(weight, name))
                continue
            weight = weight.data
            if self.tuner is None:
                setattr(module, name, cpu.pack_weight(weight, cpu.weight_layout(self.path, weight.dtype)))
                continue
            winners = float_winners[id(module), name]
            self.chosen["x".join(map(str, weight.shape))] = list(winners)
            layouts = {cpu.weight_layout(w, weight.dtype) for w in winners if w != "torch"}
            setattr(module, name, TunedWeight({layout: cpu.pack_weight(weight, layout) for layout in sorted(layouts)},
                                              weight if "torch" in winners else None, winners))
        for tuner in (self.tuner, *self.quant_tuners.values()):
            if isinstance(getattr(tuner, "timer", None), _LinearTimer):
                tuner.timer.release()

    def _float_winners(self, linear_weights: list[tuple[nn.Module, str]]) -> dict[tuple[int, str], tuple[str, ...]]:
        """The tuner's winners for each weight that stays float, by (id(module), name). A weight that torch's matmul
        wins some buckets of and a native path others is kept twice (packed, and as it is): where those second
        copies would take more than DENSE_COPY_SHARE of the memory available now (a 7B bfloat16 model's would not
        fit beside it in 24 GiB), torch's buckets go to the nearest bucket's native winner instead, and a warning
        says so."""
        if self.tuner is None:
            return {}
        weights = {(id(module), name): getattr(module, name) for module, name in linear_weights
                   if not isinstance(getattr(module, name), (quant.QuantizedTensor, quant.StackedParts))
                   and self._method(name) is None}
        winners = {key: self.tuner.winners(*weight.shape) for key, weight in weights.items()}
        copies = sum(weights[key].numel() * weights[key].element_size() for key, chosen in winners.items()
                     if "torch" in chosen and set(chosen) != {"torch"})
        available = machine.available_memory()
        if not copies or available is None or copies <= DENSE_COPY_SHARE * available:
            return winners
        warnings.warn(f"torch's matmul wins some batch sizes, but keeping its copy of the weights "
                      f"({copies / 2**30:.1f} GiB) would take more than {DENSE_COPY_SHARE:.0%} of the memory available "
                      f"({available / 2**30:.1f} GiB): those batch sizes run the nearest native winner", stacklevel=3)
        return {key: native_only(chosen) for key, chosen in winners.items()}

    def _method(self, name: str) -> str | None:
        """How the engine quantises the float weight `name` at load: None (it stays float) or a method."""
        if self.quantization not in QUANTIZATION_METHODS or name == ROUTER:
            return None  # no quantization, or a pre-quantised checkpoint's (its float weights stay so), or a router
        if name == "lm_head" and self.native:
            return quant.HEAD_METHOD[self.quantization]
        return self.quantization

    def _packed_quantized(self, qt: quant.QuantizedTensor, name: str) -> TunedWeight:
        """A quantised weight packed for its timed choices (or for `quant_path`, or for torch's int4 matmul without
        the native kernels), its choices noted under its shape and scheme."""
        if not self.native:
            winners = ("torch",) * len(BUCKETS)
        elif self.quant_timer is None:
            winners = (self.quant_path,) * len(BUCKETS)
        else:
            if qt.scheme not in self.quant_tuners:
                self.quant_tuners[qt.scheme] = self.quant_timer(qt.scheme)
            winners = self.quant_tuners[qt.scheme].winners(qt.out_features, qt.in_features)
        packed = {}
        if any(w != "torch" for w in winners):
            packed["quant"] = quant.pack_panels(qt)
        if "torch" in winners:
            packed["int4pack"] = quant.pack_torch_int4(qt, self.dtype)
        head = ", LM head" if name == "lm_head" else ""
        self.chosen[f"{qt.out_features}x{qt.in_features} ({qt.scheme.name}{head})"] = list(winners)
        return TunedWeight(packed, None, winners)

    def matmul_choices(self) -> dict[str, list[str]] | None:
        """What the autotuner chose per weight shape (and quantisation scheme) and bucket (None without one), for
        reports."""
        return dict(self.chosen) if self.tuner is not None else None


def select_backend(config: EngineConfig, device: torch.device) -> Ops | TritonOps:
    """The kernels a rank's model runs: the Triton backend where `gpu_kernels` picks it (a CUDA device under
    "auto"; "on" also in Triton's interpreter on the CPU, for tests), else the CPU's (select_ops)."""
    mode, dtype = config.gpu_kernels, config.torch_dtype
    if mode == "on" or (mode == "auto" and device.type == "cuda"):
        from mini_infer.model import triton_ops  # only here: triton loads where its kernels run

        reason = triton_ops.unavailable_reason(dtype, device, config.model_config.head_dim)
        if reason is None:
            return triton_ops.triton_ops(dtype, device)
        if mode == "on":
            raise ValueError(f"gpu_kernels 'on' but {reason}")
        return Ops(False, f"torch ops ({reason})", dtype=dtype)
    return select_ops(config.cpu_kernels, dtype, device, config.quantization, config.deterministic)


def select_ops(mode: str, dtype: torch.dtype, device: str | torch.device, quantization: str | None = None,
               deterministic: bool = False) -> Ops:
    """deterministic: the native kernels or an error (never torch's matmuls, whose reduction order depends on the
    row count), and the autotuner keeps one arithmetic per weight shape (LinearTuner's `arithmetic`)."""
    assert mode in CPU_KERNEL_MODES, mode  # EngineConfig validated it
    # int4 without the native kernels runs torch's int4 matmul; int8 and pre-quantised checkpoints have none
    # (EngineConfig refuses those without the native kernels).
    weights = f"{quantization} weights, " if quantization else ""
    torch_matmul = "torch's int4 matmul" if quantization == "int4" else "torch ops"
    if mode == "off":
        return Ops(False, f"{weights}{torch_matmul} (cpu_kernels off)", quantization=quantization, dtype=dtype)
    if torch.device(device).type != "cpu" or dtype not in cpu.DTYPES:
        if mode == "on":
            raise ValueError(f"cpu_kernels 'on' runs bfloat16/float32 models on the CPU, not {dtype} on {device}")
        return Ops(False, f"{weights}{torch_matmul} (the native kernels cover bfloat16/float32 on the CPU, not "
                          f"{dtype} on {device})", quantization=quantization, dtype=dtype)
    cpu.prebuild([*cpu.REQUIRED, *cpu.OPTIONAL, *{kernel for path in cpu.MATMUL_PATHS.values()
                                                  for _, kernel in path.kernels.values()},
                  *({kernel for kernel, _ in quant.QUANT_KERNELS.values()} if quantization else ())])
    reason = cpu.unavailable_reason()
    if reason is not None:
        if mode == "on" or quantization not in (None, "int4") or deterministic:
            needs = " with deterministic" if deterministic else ""
            raise ValueError(f"cpu_kernels {mode!r}{f' with {quantization} weights' if quantization else ''}{needs} "
                             f"but the native kernels are unavailable: {reason}")
        warnings.warn(f"native CPU kernels unavailable ({reason}); the model runs {torch_matmul}", stacklevel=2)
        return Ops(False, f"{weights}{torch_matmul} (native CPU kernels unavailable: {reason})",
                   quantization=quantization, dtype=dtype)
    float_why, quant_why = cpu.matmul_paths(dtype), quant.quant_paths(dtype) if quantization else {}
    paths = {**float_why, **quant_why}
    float_paths = tuple(path for path, why in float_why.items() if why is None)
    quant_paths = tuple(path for path, why in quant_why.items() if why is None)
    optional_missing = cpu.missing_optional()
    missing = "; ".join(f"{name}: {why}" for name, why in (*paths.items(), *optional_missing.items())
                        if why is not None)
    lacking = f" (not here: {missing})" if missing else ""
    optional = frozenset(cpu.OPTIONAL) - frozenset(optional_missing)
    head = quant.HEAD_METHOD.get(quantization, "the checkpoint's dtype")
    if quantization is not None and head != quantization:
        weights = f"{quantization} weights, LM head {head}, "
    if mode == "on":
        runs = f"{quant_paths[-1]} matmul for quantised weights, {float_paths[-1]}" if quantization else float_paths[-1]
        return Ops(True, f"native CPU kernels ({weights}{runs} matmul with packed weights, paged decode "
                         f"attention){lacking}", path=float_paths[-1], quantization=quantization,
                   quant_path=quant_paths[-1] if quant_paths else "avx2", dtype=dtype, optional=optional)
    # torch's matmul is a candidate wherever it computes the same weights: always for float weights, for int4 ones
    # through its int4 kernel (int8 groups it has none for).
    invariant = "\0batch-invariant" if deterministic else ""  # its own table: other candidates, other rule
    tuner = LinearTuner(machine_key(dtype, cpu.gemm_source() + invariant), _LinearTimer(dtype),
                        float_paths if deterministic else (*float_paths, "torch"),
                        arithmetic=(lambda path: cpu.MATMUL_PATHS[path].arithmetic) if deterministic else None)
    quant_timer = None
    if quantization is not None:
        def quant_timer(scheme: quant.Scheme) -> LinearTuner:
            torch_int4 = ("torch",) if quant.torch_int4_available(scheme, dtype) is None and not deterministic else ()
            # A quantised kernel's builds sum a group's x in vectors of their own width: one build per weight shape.
            return LinearTuner(machine_key(dtype, quant.kernel_source(scheme) + invariant),
                               _LinearTimer(dtype, scheme), (*quant_paths, *torch_int4),
                               arithmetic=(lambda path: quant.QUANT_KERNELS[path][0]) if deterministic else None)
    candidates = ", ".join(quant_paths if quantization else float_paths)
    torch_named = {None: " and torch's matmul", "int4": " and torch's int4 matmul"}.get(quantization, "")
    if deterministic:
        torch_named = " in one arithmetic (batch-invariant)"
    return Ops(True, f"native CPU kernels ({weights}paged decode attention; per weight shape and batch size, the "
                     f"fastest of {candidates}{torch_named}, timed once: {tuner.path.parent}){lacking}", tuner,
               quantization=quantization, quant_timer=quant_timer, dtype=dtype, optional=optional)


ROUTER = "gate"  # a mixture's router (model/moe.py SparseMoeBlock.gate): kept in the model's dtype


def _prepared(weight) -> bool:
    """Whether Ops.prepare has packed `weight` (a StackedParts' parts each packed make a tuple)."""
    return isinstance(weight, TunedWeight) or (isinstance(weight, tuple) and all(isinstance(w, TunedWeight)
                                                                                  for w in weight))


class _LinearTimer:
    """Times one call of a candidate matmul on random data of a weight's shape (the weights made once per shape,
    the rows once per row count): a float weight, or random integers and scales of the quantised scheme
    (quant.random_quantized).

    A decode step's matmuls (up to STREAMING_ROWS rows, the decode buckets) stream their weights from memory (a
    model's weights far exceed the caches), so those calls are timed with the weight's lines flushed from every cache
    level first: timed cache-hot, a kernel that streams memory best could lose to one that only computes faster."""

    STREAMING_ROWS = 64

    def __init__(self, dtype: torch.dtype, scheme: quant.Scheme | None = None) -> None:
        self.dtype, self.scheme, self._shape, self._weights, self._rows = dtype, scheme, None, {}, {}

    def release(self) -> None:
        """Drop the timing data (the last shape's weights and rows) once the model's weights are prepared."""
        self._shape, self._weights, self._rows = None, {}, {}

    def __call__(self, candidate: str, rows: int, out_features: int, in_features: int) -> float:
        if self._shape != (out_features, in_features):
            self._shape, self._rows, self._weights = (out_features, in_features), {}, {}
            if self.scheme is not None:
                qt = quant.random_quantized(self.scheme, out_features, in_features)
                self._weights = {"quant": quant.pack_panels(qt)}
                if quant.torch_int4_available(self.scheme, self.dtype) is None:
                    self._weights["torch"] = quant.pack_torch_int4(qt, self.dtype)
            else:
                self._weights = {"torch": torch.randn(out_features, in_features).to(self.dtype)}
        if rows not in self._rows:
            self._rows[rows] = torch.randn(rows, in_features).to(self.dtype)
        x = self._rows[rows]
        if self.scheme is not None:
            if candidate == "torch":
                weight = self._weights["torch"]
                return timed_ms(lambda: quant.torch_int4_linear(x, weight), self._before(rows, weight.tensors()))
            panels = self._weights["quant"]
            before = self._before(rows, panels.tensors())
            return timed_ms(lambda: quant.quant_linear(x, panels, None, candidate), before)
        dense = self._weights["torch"]
        if candidate == "torch":
            return timed_ms(lambda: F.linear(x, dense), self._before(rows, [dense]))
        layout = cpu.weight_layout(candidate, self.dtype)
        if layout not in self._weights:
            self._weights[layout] = cpu.pack_weight(dense, layout)
        packed = self._weights[layout]
        return timed_ms(lambda: cpu.linear(x, packed, None, candidate), self._before(rows, packed.tensors()))

    def _before(self, rows: int, weight: list[torch.Tensor]) -> Callable[[], None] | None:
        """What runs untimed before a call: a decode-sized one first flushes its weight from the caches."""
        return (lambda: cpu.flush_caches(weight)) if rows <= self.STREAMING_ROWS else None
