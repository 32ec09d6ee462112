"""The matmul workload: one decode step's matmuls of the model's shape (every layer's QKV, O, gate/up and down weights
and the LM head, random, packed as the engine packs them), called in a step's order so that the weights stream from
memory as in a real step, on each native path that runs here; with --quantization, the step's weights quantised
(the LM head in its method's head format) on each quantised path against the bfloat16 kernel, in an order shuffled
every round (the machine's memory speed drifts within seconds: each round's ratio compares neighbours)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.report import Column, Workload
from mini_infer.config import ModelConfig
from mini_infer.kernels import cpu, quant

KINDS = ("qkv", "o", "gate_up", "down", "head")


def step_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each kind of matmul in a decode step."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "head": (config.vocab_size, hidden)}


def _timed_step(linear: Callable, path: str, weights: list[tuple[str, object]],
                xs: dict[int, torch.Tensor]) -> dict[str, float]:
    seconds = dict.fromkeys(KINDS, 0.0)
    for kind, weight in weights:
        start = time.perf_counter()
        linear(xs[weight.in_features], weight, path=path)
        seconds[kind] += time.perf_counter() - start
    return seconds


def run_matmul(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    config = ModelConfig.from_dir(model_dir)
    shapes, dtype = step_shapes(config), getattr(torch, options.dtype)
    torch.manual_seed(0)
    dense = [(kind, (torch.randn(shape) * 0.02).to(dtype))
             for kind, shape in shapes.items() for _ in range(1 if kind == "head" else config.num_hidden_layers)]
    float_paths = [path for path, why in cpu.matmul_paths(dtype).items() if why is None]
    systems = {}  # label -> (matmul, path, the step's (kind, packed weight))
    for path in float_paths[-1:] if options.quantization else float_paths:
        layout = cpu.weight_layout(path, dtype)
        systems[f"{options.dtype} {path}"] = (cpu.linear, path, [(k, cpu.pack_weight(w, layout)) for k, w in dense])
    for method in options.quantization or ():
        packed = [(kind, quant.pack_panels(quant.quantize(w, quant.HEAD_METHOD[method] if kind == "head" else method,
                                                          quant.scale_dtype(dtype)))) for kind, w in dense]
        for path, why in quant.quant_paths(dtype).items():
            if why is None:
                systems[f"{method} {path}"] = (quant.quant_linear, path, packed)
    del dense
    base, rows = next(iter(systems)), []
    for m in options.batch_sizes:
        xs = {k: torch.randn(m, k).to(dtype) for k in {shape[1] for shape in shapes.values()}}
        for label in systems:  # warm-up
            _timed_step(*systems[label], xs)
        times = {label: [] for label in systems}
        order, shuffle = list(systems), random.Random(0).shuffle
        for _ in range(options.reps):
            shuffle(order)
            for label in order:
                times[label].append(_timed_step(*systems[label], xs))
        for label, samples in times.items():
            totals = [sum(s.values()) for s in samples]
            step_s = statistics.median(totals)
            weights = systems[label][2]
            nbytes = sum(t.numel() * t.element_size() for _, w in weights for t in w.tensors())
            flop = 2 * m * sum(w.out_features * w.in_features for _, w in weights)
            rows.append({"rows": m, "system": label, "step_s": step_s, "gb_s": nbytes / step_s / 1e9,
                         "gflop_s": flop / step_s / 1e9,
                         "ratio": statistics.median(sum(b.values()) / t for b, t in zip(times[base], totals)),
                         **{f"{kind}_s": statistics.median(s[kind] for s in samples) for kind in KINDS}})
            log(f"matmul M={m} {label}: {1e3 * step_s:.2f} ms a step")
    settings = {"model": model_dir, "dtype": options.dtype, "layers": config.num_hidden_layers,
                "rounds": options.reps, "baseline": base,
                "quantization": list(options.quantization)}
    return {"workload": "matmul", "config": settings, "rows": rows}


def _chart(report: dict) -> tuple[str, list[Panel]]:
    rows, config = report["rows"], report["config"]
    sizes = sorted({r["rows"] for r in rows})
    series = [Series(label, [next(r["gb_s"] for r in rows if r["rows"] == m and r["system"] == label) for m in sizes])
              for label in dict.fromkeys(r["system"] for r in rows)]
    return (f"a decode step's matmuls: {Path(config['model']).name}, {config['dtype']}",
            [Panel("weights read (GB/s)", [f"M={m}" for m in sizes], series)])


HEADLINE = ("{model}: one decode step's matmuls ({layers} layers' QKV, O, gate/up and down, and the LM head), "
            "{rounds} rounds in a shuffled order, medians; ratio: the median of each round's step time of {baseline} "
            "over this system's")
MATMUL = Workload(run_matmul, lambda report: [HEADLINE.format_map(report["config"])], (
    Column("rows", "rows"), Column("system", "system"),
    *(Column(f"{kind} ms", f"{kind}_s", "{:.2f}", 1e3) for kind in KINDS),
    Column("step ms", "step_s", "{:.2f}", 1e3), Column("GB/s", "gb_s", "{:.1f}"),
    Column("GFLOP/s", "gflop_s", "{:.1f}"), Column("ratio", "ratio", "{:.3f}x")),
    lambda report: report["rows"], _chart)
