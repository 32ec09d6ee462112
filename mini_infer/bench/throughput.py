"""The workloads that compare the systems: fixed (per batch size B, B real-text prompts of one length, output
tokens/s against the decode roofline measured on this machine), prefill (one long real-text prompt and one new
token: time to first token and the GFLOP/s it ran at against the machine's matmul peak), random (requests of
random input and output lengths submitted at once; throughput and request latency, finish time minus the common
submit time) and nano-vllm (nano-vllm's benchmark: the random workload's measures on its requests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import (NANO_VLLM_HIGH, NANO_VLLM_LOW, NANO_VLLM_TEMPERATURE, RandomRequests,
                                      fixed_prompts, load_stream, nano_vllm_requests, random_requests)
from mini_infer.bench.report import Column, RunResult, Workload, percentile, speedup, summarize
from mini_infer.bench.roofline import Ceilings, DecodeCost, measure_ceilings, prefill_flops, roofline
from mini_infer.bench.systems import Case, SystemFactory, run_systems
from mini_infer.config import ModelConfig

BASELINE = "hf-generate"
RANDOM_WARMUP_REQUESTS, RANDOM_WARMUP_PROMPT_LEN, RANDOM_WARMUP_OUTPUT_LEN = 2, 16, 8
PROMPT_SOURCE = "slices of the built-in English texts' token stream, at seeded random offsets"
VS_BASELINE = Column("vs hf-generate", "speedup_vs_hf_generate", "{:.2f}x")


def run_fixed(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream, new_tokens = load_stream(model_dir), options.max_new_tokens
    warmup_tokens = min(options.warmup_tokens, new_tokens)
    cases = []
    for batch_size in options.batch_sizes:
        prompts = fixed_prompts(stream, batch_size, options.prompt_len)
        cases.append(Case(f"B={batch_size}", prompts, [new_tokens] * batch_size, prompts, [warmup_tokens] * batch_size))
    dtype = getattr(torch, options.dtype)
    log(f"measuring the machine's ceilings ({options.dtype} matmul, memory read)")
    ceilings = measure_ceilings(dtype, options.device)
    cost = DecodeCost.from_config(ModelConfig.from_dir(model_dir), dtype.itemsize)
    factory = SystemFactory(model_dir, options.dtype, max_requests=max(options.batch_sizes),
                            max_seq_len=options.prompt_len + new_tokens, gguf_outtype=options.gguf_outtype, log=log,
                            measure_rss=any(name.startswith("mini-infer-int") for name in options.systems),
                            device=options.device)
    records = run_systems(factory, list(options.systems), cases, options.reps, log,
                          one_at_a_time=options.one_at_a_time)
    points = {b: roofline(cost, ceilings, b) for b in options.batch_sizes}
    systems = {name: {"reason": record["reason"], "setup": record["setup"],
                      "results": [_batch_result(b, record["runs"][f"B={b}"], b * new_tokens, points[b].tok_s)
                                  for b in options.batch_sizes] if record["reason"] is None else []}
               for name, record in records.items()}
    for system in systems.values():  # what the system holds in memory, beside each of its results
        setup = system["setup"] or {}
        for result in system["results"]:
            result.update({key: setup[key] / 1e6 for key in ("weight_bytes", "rss_bytes") if setup.get(key)})
    base = {r["batch_size"]: r["tok_s"]["median"] for r in systems.get(BASELINE, {}).get("results", [])}
    for system in systems.values():
        for result in system["results"]:
            result["speedup_vs_hf_generate"] = speedup(result["tok_s"]["median"], base.get(result["batch_size"]))
    config = {"model": model_dir, "dtype": options.dtype, "device": options.device, "systems": list(options.systems),
              "reps": options.reps, "one_at_a_time": options.one_at_a_time, "batch_sizes": list(options.batch_sizes),
              "prompt_len": options.prompt_len,
              "max_new_tokens": new_tokens, "warmup_tokens": options.warmup_tokens}
    return {"workload": "fixed", "config": config, "ceilings": asdict(ceilings), "decode_cost": asdict(cost),
            "roofline": [asdict(p) for p in points.values()], "systems": systems}


def _batch_result(batch_size: int, runs: list[RunResult], expected_tokens: int, roofline_tok_s: float) -> dict:
    tok_s = [run.output_tokens / run.wall_s for run in runs]
    summary = summarize(tok_s)
    return {"batch_size": batch_size, "expected_output_tokens": expected_tokens,
            "runs": [{"wall_s": run.wall_s, "output_tokens": run.output_tokens, "tok_s": rate}
                     for run, rate in zip(runs, tok_s)],
            "tok_s": summary, "pct_of_roofline": 100 * summary["median"] / roofline_tok_s}


def _compute_ceiling(ceilings: dict) -> str:
    measured = ", ".join(f"{dtype} {rate:.1f}" for dtype, rate in ceilings["matmul_gflops"].items())
    return (f"compute {ceilings['compute_peak_gflops']:.1f} GFLOP/s ({ceilings['compute_peak_source']} matmul; "
            f"measured {measured})")


def _fixed_headline(report: dict) -> list[str]:
    config, ceilings = report["config"], report["ceilings"]
    memory = ceilings.get("memory_kind", "read")
    memory = "memory read" if memory == "read" else f"memory ({memory}: bytes read + written)"
    lines = [f"{config['model']} ({config['dtype']}), {config['prompt_len']} prompt + {config['max_new_tokens']} "
             f"new tokens per request, {config['reps']} reps" + (", each system loaded alone once a rep, in turn"
                                                                   if config.get("one_at_a_time") else ""),
             f"ceilings: {_compute_ceiling(ceilings)}, {memory} {ceilings['read_gbs']:.1f} GB/s; a decode step "
             f"reads {report['decode_cost']['weight_bytes'] / 1e6:.0f} MB of {config['dtype']} weights (the roofline)"]
    if any("weight_bytes" in r for s in report["systems"].values() for r in s["results"]):
        lines.append("weights MB: the weights a system holds (mini-infer's tensors, llama.cpp's GGUF file); RSS MB: "
                     "the resident set of a process holding only that system (mini-infer's engine loaded once more in "
                     "a process of its own; a peer's worker)")
    return lines


def _fixed_rows(report: dict) -> list[dict]:
    """Per batch size the roofline, then every system that ran."""
    rows = []
    for point in report["roofline"]:
        rows.append({"system": f"roofline ({point['bound']})", "batch_size": point["batch_size"],
                     "tok_s": {"median": point["tok_s"]}, "pct_of_roofline": 100})
        rows += [{"system": name, **result, "spread": result["tok_s"]} for name, system in report["systems"].items()
                 for result in system["results"] if result["batch_size"] == point["batch_size"]]
    return rows


def _fixed_chart(report: dict) -> tuple[str, list[Panel]]:
    """Each system's median with its min-max against batch size, the roofline dashed at every batch size in
    the range (so that its knee shows)."""
    config, sizes = report["config"], report["config"]["batch_sizes"]
    cost, ceilings = DecodeCost(**report["decode_cost"]), Ceilings(**report["ceilings"])
    line = [roofline(cost, ceilings, b) for b in range(sizes[0], sizes[-1] + 1)]
    series = [Series("roofline", [p.tok_s for p in line], x=[p.batch_size for p in line], style="k--")]
    series += [Series.spread(name, [r["tok_s"] for r in s["results"]], x=[r["batch_size"] for r in s["results"]])
               for name, s in report["systems"].items() if s["results"]]
    return (f"{Path(config['model']).name}, {config['dtype']}, {config['prompt_len']} prompt + "
            f"{config['max_new_tokens']} new tokens, {report['machine']['torch_threads']} threads",
            [Panel("output tokens / s", sizes, series, lines=True, xlabel="batch size")])


def run_prefill(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    """One request of --prompt-len tokens and a single new token: its wall time is the time to first token."""
    prompt = fixed_prompts(load_stream(model_dir), 1, options.prompt_len)
    case = Case("prefill", prompt, [1], prompt, [1])
    dtype = getattr(torch, options.dtype)
    log(f"measuring the machine's ceilings ({options.dtype} matmul, memory read)")
    ceilings = measure_ceilings(dtype, options.device)
    flops = prefill_flops(ModelConfig.from_dir(model_dir), options.prompt_len)
    factory = SystemFactory(model_dir, options.dtype, max_requests=1, max_seq_len=options.prompt_len + 1,
                            gguf_outtype=options.gguf_outtype, log=log, device=options.device)
    records = run_systems(factory, list(options.systems), [case], options.reps, log)
    systems = {}
    for name, record in records.items():
        runs = [{"ttft_s": run.wall_s, "gflops": flops / run.wall_s / 1e9} for run in record["runs"].get("prefill", [])]
        summary = None
        if runs:
            ttft = summarize([1e3 * run["ttft_s"] for run in runs])
            gflops = flops / ttft["median"] / 1e6
            summary = {"ttft_ms": ttft, "prompt_tok_s": 1e3 * options.prompt_len / ttft["median"], "gflops": gflops,
                       "pct_of_compute_peak": 100 * gflops / ceilings.compute_peak_gflops}
        systems[name] = {"reason": record["reason"], "setup": record["setup"], "runs": runs, "summary": summary}
    base = (systems.get(BASELINE) or {}).get("summary")
    for summary in (s["summary"] for s in systems.values() if s["summary"] is not None):
        summary["speedup_vs_hf_generate"] = speedup(base["ttft_ms"]["median"], summary["ttft_ms"]["median"]) \
            if base else None
    config = {"model": model_dir, "dtype": options.dtype, "device": options.device, "systems": list(options.systems),
              "reps": options.reps, "prompt_len": options.prompt_len, "max_new_tokens": 1}
    return {"workload": "prefill", "config": config, "ceilings": asdict(ceilings), "prefill_flops": flops,
            "systems": systems}


def _prefill_headline(report: dict) -> list[str]:
    config = report["config"]
    return [f"{config['model']} ({config['dtype']}), one prompt of {config['prompt_len']} tokens and 1 new token "
            f"(its prefill: {report['prefill_flops'] / 1e9:.1f} GFLOP), {config['reps']} reps",
            f"ceiling: {_compute_ceiling(report['ceilings'])}"]


def _prefill_chart(report: dict) -> tuple[str, list[Panel]]:
    ran = {name: s["summary"] for name, s in report["systems"].items() if s["summary"] is not None}
    names, config = list(ran), report["config"]
    return (f"prefill of {config['prompt_len']} tokens, {Path(config['model']).name}, {config['dtype']}",
            [Panel("time to first token (ms)", names, [Series("TTFT", [ran[n]["ttft_ms"]["median"] for n in names])]),
             Panel("GFLOP/s", names, [
                 Series("achieved", [ran[n]["gflops"] for n in names]),
                 Series("compute peak", [report["ceilings"]["compute_peak_gflops"]] * len(names))])])


def run_random(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    """Every system serves the same seeded requests."""
    requests = random_requests(load_stream(model_dir), options.num_requests, options.input_len_range,
                               options.output_len_range, options.seed)
    config = {"num_requests": options.num_requests, "input_len_range": list(options.input_len_range),
              "output_len_range": list(options.output_len_range), "seed": options.seed,
              "prompt_source": PROMPT_SOURCE}
    return _serve_requests("random", options, model_dir, requests, 0.0, config, log)


def run_nano_vllm(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    """nano-vllm's bench.py as its authors run it (prompts.nano_vllm_requests), each system timed over the whole
    batch submitted at once."""
    requests = nano_vllm_requests()
    config = {"num_requests": len(requests.prompts), "input_len_range": [NANO_VLLM_LOW, NANO_VLLM_HIGH],
              "output_len_range": [NANO_VLLM_LOW, NANO_VLLM_HIGH], "seed": 0, "temperature": NANO_VLLM_TEMPERATURE,
              "prompt_source": "random token ids in [0, 10000], as nano-vllm's bench.py draws them"}
    return _serve_requests("nano-vllm", options, model_dir, requests, NANO_VLLM_TEMPERATURE, config, log)


def _serve_requests(workload: str, options: BenchOptions, model_dir: str, requests: RandomRequests,
                    temperature: float, settings: dict, log: Callable[[str], None]) -> dict:
    warmup = [p[:RANDOM_WARMUP_PROMPT_LEN] for p in requests.prompts[:RANDOM_WARMUP_REQUESTS]]
    case = Case(workload, requests.prompts, requests.output_lens, warmup,
                [RANDOM_WARMUP_OUTPUT_LEN] * len(warmup), temperature)
    factory = SystemFactory(model_dir, options.dtype, max_requests=len(requests.prompts),
                            max_seq_len=max(len(p) + n for p, n in zip(requests.prompts, requests.output_lens)),
                            static_batch_size=options.batch_size, gguf_outtype=options.gguf_outtype, log=log,
                            device=options.device)
    records = run_systems(factory, list(options.systems), [case], options.reps, log)
    prompt_tokens = sum(len(p) for p in case.prompts)
    systems = {}
    for name, record in records.items():
        runs = [_random_metrics(run, prompt_tokens) for run in record["runs"].get(workload, [])]
        summary = {key: summarize([run[key] for run in runs])
                   for key in ("output_tok_s", "total_tok_s", "latency_p50_s", "latency_p99_s")} if runs else None
        systems[name] = {"reason": record["reason"], "setup": record["setup"], "runs": runs, "summary": summary}
    base = (systems.get(BASELINE) or {}).get("summary")
    for summary in (s["summary"] for s in systems.values() if s["summary"] is not None):
        summary["speedup_vs_hf_generate"] = speedup(summary["output_tok_s"]["median"],
                                                    base and base["output_tok_s"]["median"])
    config = {"model": model_dir, "dtype": options.dtype, "device": options.device, "systems": list(options.systems),
              "reps": options.reps, "hf_generate_batch_size": options.batch_size, **settings}
    return {"workload": workload, "config": config,
            "requests": {"prompt_tokens": prompt_tokens, "output_tokens": sum(case.output_lens),
                         "input_lens": [len(p) for p in case.prompts], "output_lens": list(case.output_lens)},
            "systems": systems}


def _random_metrics(run: RunResult, prompt_tokens: int) -> dict:
    return {"wall_s": run.wall_s, "output_tokens": run.output_tokens, "output_tok_s": run.output_tokens / run.wall_s,
            "total_tok_s": (prompt_tokens + run.output_tokens) / run.wall_s,
            "latency_p50_s": percentile(run.finish_s, 50), "latency_p99_s": percentile(run.finish_s, 99),
            "latencies_s": list(run.finish_s)}


def _random_headline(report: dict) -> list[str]:
    config, requests = report["config"], report["requests"]
    sampled = f"sampled at temperature {config['temperature']}" if config.get("temperature") else "greedy"
    return [f"{config['model']} ({config['dtype']}), {config['num_requests']} requests submitted at once: "
            f"{requests['prompt_tokens']} prompt + {requests['output_tokens']} output tokens (input lengths "
            f"U{config['input_len_range']}, output U{config['output_len_range']}, seed {config['seed']}, {sampled}; "
            f"{config['prompt_source']}); hf-generate runs static batches of {config['hf_generate_batch_size']}, "
            f"{config['reps']} reps"]


def _random_chart(report: dict) -> tuple[str, list[Panel]]:
    """Output tokens/s per system, beside request latency p50 and p99."""
    ran = {name: s["summary"] for name, s in report["systems"].items() if s["summary"] is not None}
    names, config = list(ran), report["config"]
    median = {key: [ran[n][key]["median"] for n in names] for key in ("output_tok_s", "latency_p50_s", "latency_p99_s")}
    return (f"{report['workload']} workload: {config['num_requests']} requests, {Path(config['model']).name}, "
            f"{config['dtype']}",
            [Panel("output tokens / s", names, [Series("output tok/s", median["output_tok_s"])]),
             Panel("request latency (s)", names, [Series("p50", median["latency_p50_s"]),
                                                  Series("p99", median["latency_p99_s"])])])


FIXED = Workload(run_fixed, _fixed_headline, (
    Column("system", "system"), Column("batch", "batch_size"), Column("tok/s", "tok_s", "{0[median]:.1f}"),
    Column("min-max", "spread", "{0[min]:.1f}-{0[max]:.1f}"), Column("% roofline", "pct_of_roofline", "{:.0f}%"),
    VS_BASELINE, Column("weights MB", "weight_bytes", "{:.0f}"), Column("RSS MB", "rss_bytes", "{:.0f}")),
    _fixed_rows, _fixed_chart)
_SERVED_COLUMNS = (
    Column("system", "system"), Column("output tok/s", "output_tok_s", "{0[median]:.1f}"),
    Column("total tok/s", "total_tok_s", "{0[median]:.1f}"),
    Column("p50 latency s", "latency_p50_s", "{0[median]:.2f}"),
    Column("p99 latency s", "latency_p99_s", "{0[median]:.2f}"), VS_BASELINE)


def _served_rows(report: dict) -> list[dict]:
    return [{"system": name, **s["summary"]} for name, s in report["systems"].items() if s["summary"]]


RANDOM = Workload(run_random, _random_headline, _SERVED_COLUMNS, _served_rows, _random_chart)
NANO_VLLM = Workload(run_nano_vllm, _random_headline, _SERVED_COLUMNS, _served_rows, _random_chart)
PREFILL = Workload(run_prefill, _prefill_headline, (
    Column("system", "system"), Column("TTFT ms", "ttft_ms", "{0[median]:.0f}"),
    Column("min-max ms", "ttft_ms", "{0[min]:.0f}-{0[max]:.0f}"),
    Column("prompt tok/s", "prompt_tok_s", "{:.0f}"), Column("GFLOP/s", "gflops", "{:.1f}"),
    Column("% compute peak", "pct_of_compute_peak", "{:.0f}%"), VS_BASELINE),
    lambda report: [{"system": name, **s["summary"]} for name, s in report["systems"].items() if s["summary"]],
    _prefill_chart)
