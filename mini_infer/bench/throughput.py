"""The fixed workload: per batch size B, B real-text prompts of the same length, each generating the same number
of tokens; each system's output tokens/s against the decode roofline measured on this machine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import describe_machine, format_table, summarize
from mini_infer.bench.roofline import Ceilings, DecodeCost, RooflinePoint, measure_ceilings, roofline
from mini_infer.bench.systems import Case, RunResult, SystemFactory, SystemRecord, run_systems
from mini_infer.config import ModelConfig

BASELINE = "hf-generate"


def run_fixed(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    """Measure the ceilings, then every system over every batch size; returns the report."""
    stream = load_stream(model_dir)
    new_tokens, warmup_tokens = options.max_new_tokens, min(options.warmup_tokens, options.max_new_tokens)
    cases = []
    for batch_size in options.batch_sizes:
        prompts = fixed_prompts(stream, batch_size, options.prompt_len)
        cases.append(Case(f"B={batch_size}", prompts, [new_tokens] * batch_size,
                          prompts, [warmup_tokens] * batch_size))
    dtype = getattr(torch, options.dtype)
    log(f"measuring the machine's ceilings ({options.dtype} matmul, memory read)")
    ceilings = measure_ceilings(dtype)
    cost = DecodeCost.from_config(ModelConfig.from_dir(model_dir), dtype.itemsize)
    factory = SystemFactory(model_dir, options.dtype, max_requests=max(options.batch_sizes),
                            max_seq_len=options.prompt_len + new_tokens)
    records = run_systems(factory, list(options.systems), cases, options.reps, log)
    return fixed_report(options, model_dir, ceilings, cost, records)


def fixed_report(options: BenchOptions, model_dir: str, ceilings: Ceilings, cost: DecodeCost,
                 records: dict[str, SystemRecord]) -> dict:
    points = {b: roofline(cost, ceilings, b) for b in options.batch_sizes}
    systems = {}
    for name, record in records.items():
        results = [_batch_result(b, record.runs[f"B={b}"], b * options.max_new_tokens, points[b])
                   for b in options.batch_sizes] if record.reason is None else []
        systems[name] = {"reason": record.reason, "results": results}
    baseline = {r["batch_size"]: r["tok_s"]["median"] for r in systems.get(BASELINE, {}).get("results", [])}
    for system in systems.values():
        for result in system["results"]:
            base = baseline.get(result["batch_size"])
            result["speedup_vs_hf_generate"] = result["tok_s"]["median"] / base if base else None
    config = {"model": model_dir, "dtype": options.dtype, "systems": list(options.systems), "reps": options.reps,
              "batch_sizes": list(options.batch_sizes), "prompt_len": options.prompt_len,
              "max_new_tokens": options.max_new_tokens, "warmup_tokens": options.warmup_tokens}
    return {"workload": "fixed", "config": config,
            "ceilings": asdict(ceilings), "decode_cost": asdict(cost),
            "roofline": [asdict(p) for p in points.values()], "systems": systems}


def _batch_result(batch_size: int, runs: list[RunResult], expected_tokens: int, point: RooflinePoint) -> dict:
    tok_s = [run.output_tokens / run.wall_s for run in runs]
    summary = summarize(tok_s)
    return {"batch_size": batch_size, "expected_output_tokens": expected_tokens,
            "runs": [{"wall_s": run.wall_s, "output_tokens": run.output_tokens, "tok_s": rate}
                     for run, rate in zip(runs, tok_s)],
            "tok_s": summary, "pct_of_roofline": 100 * summary["median"] / point.tok_s}


def fixed_table(report: dict) -> str:
    """The report as a system x batch size table, preceded by the setting and the ceilings."""
    config, ceilings = report["config"], report["ceilings"]
    raw = ", ".join(f"{dtype} {rate:.1f}" for dtype, rate in ceilings["matmul_gflops"].items())
    lines = [f"{config['model']} ({config['dtype']}), {config['prompt_len']} prompt + {config['max_new_tokens']} "
             f"new tokens per request, {config['reps']} reps", describe_machine(report["machine"]),
             f"ceilings: compute {ceilings['compute_peak_gflops']:.1f} GFLOP/s ({ceilings['compute_peak_source']} "
             f"matmul; measured {raw}), memory read {ceilings['read_gbs']:.1f} GB/s; a decode step reads "
             f"{report['decode_cost']['weight_bytes'] / 1e6:.0f} MB of weights", ""]
    rows = []
    for point in report["roofline"]:
        batch_size = point["batch_size"]
        rows.append([f"roofline ({point['bound']})", batch_size, f"{point['tok_s']:.1f}", "", "100%", ""])
        for name, system in report["systems"].items():
            for result in system["results"]:
                if result["batch_size"] == batch_size:
                    rows.append(_row(name, result))
    lines.append(format_table(["system", "batch", "tok/s", "min-max", "% roofline", "vs hf-generate"], rows))
    lines += [f"{name}: skipped ({system['reason']})" for name, system in report["systems"].items()
              if system["reason"] is not None]
    return "\n".join(lines)


def _row(name: str, result: dict) -> list:
    tok_s, speedup = result["tok_s"], result["speedup_vs_hf_generate"]
    return [name, result["batch_size"], f"{tok_s['median']:.1f}", f"{tok_s['min']:.1f}-{tok_s['max']:.1f}",
            f"{result['pct_of_roofline']:.0f}%", f"{speedup:.2f}x" if speedup is not None else "-"]
