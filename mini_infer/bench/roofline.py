"""Machine ceilings (matmul GFLOP/s, memory read GB/s; on a GPU its device copy, bytes read and written), measured
in-process, and the decode roofline they set.

A decode step reads every weight once and does 2 FLOPs per linear parameter per sequence, so its time is at
least max(weight bytes / read bandwidth, FLOPs / compute peak). KV-cache reads and attention FLOPs are left
out: they are small next to the weights at these context lengths, and leaving them out keeps it a bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mini_infer.config import ModelConfig

FP32_MATMUL_SIZE = 2048
# CPUs without native bf16/fp16 units run torch's low-precision matmul on a slow path (a 2048-square bf16
# product can take a minute), so those dtypes are measured on a smaller square.
LOW_PRECISION_MATMUL_SIZE = 512
READ_BYTES = 256 * 2**20
GPU_MATMUL_SIZE = 8192
GPU_COPY_BYTES = 2**30  # each of source and destination: many times any GPU's L2


@dataclass(frozen=True, slots=True)
class Ceilings:
    matmul_gflops: dict[str, float]  # dtype name -> best measured torch.mm rate
    matmul_sizes: dict[str, int]  # dtype name -> side of the square matrices
    compute_peak_gflops: float
    compute_peak_source: str  # the dtype whose matmul sets the peak
    read_gbs: float
    # How read_gbs was measured: "read" (a sum over a buffer, on the CPU) or "device copy" (a GPU's copy of one buffer
    # into another, counting the bytes read and written, as GPU bandwidth is quoted).
    memory_kind: str = "read"


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_gflops(dtype: torch.dtype, size: int, reps: int = 3) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: torch.mm(a, b), reps) / 1e9


def measure_read_gbs(num_bytes: int = READ_BYTES, reps: int = 5) -> float:
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_seconds(data.sum, reps) / 1e9


def _cuda_seconds(fn, reps: int) -> float:
    """The median of `reps` timed calls after a warm-up, each timed with CUDA events around it."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _gpu_matmul_gflops(dtype: torch.dtype, device: torch.device, reps: int) -> float:
    a, b = (torch.randn(GPU_MATMUL_SIZE, GPU_MATMUL_SIZE, device=device).to(dtype) for _ in range(2))
    return 2 * GPU_MATMUL_SIZE**3 / _cuda_seconds(lambda: torch.mm(a, b), reps) / 1e9


def measure_gpu_ceilings(dtype: torch.dtype, device: torch.device, reps: int = 10) -> Ceilings:
    """A GPU's matmul rate at `dtype` (and float32) on random squares of GPU_MATMUL_SIZE, and its device copy
    bandwidth (bytes read + written) over GPU_COPY_BYTES."""
    rates = {str(each).removeprefix("torch."): _gpu_matmul_gflops(each, device, reps)
             for each in {torch.float32, dtype}}
    sizes = dict.fromkeys(rates, GPU_MATMUL_SIZE)
    source = torch.empty(GPU_COPY_BYTES // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    copy_gbs = 2 * GPU_COPY_BYTES / _cuda_seconds(lambda: target.copy_(source), reps) / 1e9
    peak = max(rates, key=rates.get)
    return Ceilings(matmul_gflops=rates, matmul_sizes=sizes, compute_peak_gflops=rates[peak], compute_peak_source=peak,
                    read_gbs=copy_gbs, memory_kind="device copy")


def measure_ceilings(dtype: torch.dtype, device: str = "cpu") -> Ceilings:
    """Compute peak at `dtype`; for a narrower dtype it is max(its own matmul, fp32 matmul), because its data
    can always be widened and computed with fp32 FMAs. On a CUDA device, the GPU's (measure_gpu_ceilings)."""
    if torch.device(device).type == "cuda":
        return measure_gpu_ceilings(dtype, torch.device(device))
    name = str(dtype).removeprefix("torch.")
    rates = {"float32": measure_matmul_gflops(torch.float32, FP32_MATMUL_SIZE)}
    sizes = {"float32": FP32_MATMUL_SIZE}
    if dtype != torch.float32:
        rates[name] = measure_matmul_gflops(dtype, LOW_PRECISION_MATMUL_SIZE)
        sizes[name] = LOW_PRECISION_MATMUL_SIZE
    source = max(rates, key=rates.get)
    return Ceilings(matmul_gflops=rates, matmul_sizes=sizes, compute_peak_gflops=rates[source],
                    compute_peak_source=source, read_gbs=measure_read_gbs())


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """What one decode step must read and multiply, whatever the batch size."""

    weight_bytes: int  # every layer weight and bias, the final norm and the LM head
    matmul_params: int  # parameters of every linear in the layers, plus the LM head

    @classmethod
    def from_config(cls, config: ModelConfig, itemsize: int) -> DecodeCost:
        """A tied head counts once (as the LM head); an untied embedding is left out, as a step reads only
        its batch's rows of it."""
        hidden, layers = config.hidden_size, config.num_hidden_layers
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        linear = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size
        biases, norms = q_size + 2 * kv_size, 2 * hidden
        head = config.vocab_size * hidden
        weights = layers * (linear + biases + norms) + hidden + head
        return cls(weight_bytes=weights * itemsize, matmul_params=layers * linear + head)


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    batch_size: int
    step_s: float
    tok_s: float
    bound: str  # "memory" or "compute"


def roofline(cost: DecodeCost, ceilings: Ceilings, batch_size: int) -> RooflinePoint:
    memory_s = cost.weight_bytes / (ceilings.read_gbs * 1e9)
    compute_s = 2 * cost.matmul_params * batch_size / (ceilings.compute_peak_gflops * 1e9)
    step_s = max(memory_s, compute_s)
    return RooflinePoint(batch_size, step_s, batch_size / step_s, "memory" if memory_s >= compute_s else "compute")


def prefill_flops(config: ModelConfig, prompt_len: int) -> int:
    """The multiply-adds (x2) of one prompt's prefill: every layer linear over all its tokens, causal attention
    (q k^T and the weighted sum of v over each token's prefix) and the LM head on its last token only."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden = config.hidden_size
    linear = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size
    attention = 2 * q_size * prompt_len * (prompt_len + 1) // 2  # scores and weighted sum, per layer
    return 2 * (config.num_hidden_layers * (linear * prompt_len + attention) + config.vocab_size * hidden)

