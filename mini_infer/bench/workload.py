"""The random workload: requests of random input and output lengths, all submitted at once; throughput and
request latency (finish time minus the common submit time) per system."""

from __future__ import annotations

from collections.abc import Callable

from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import load_stream, random_requests
from mini_infer.bench.report import describe_machine, format_table, percentile, summarize
from mini_infer.bench.systems import Case, RunResult, SystemFactory, SystemRecord, run_systems

BASELINE = "hf-generate"
LABEL = "random"
WARMUP_REQUESTS, WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 2, 16, 8
PROMPT_SOURCE = "slices of the built-in English texts' token stream, at seeded random offsets"


def run_random(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    """Every system serves the same seeded requests; returns the report."""
    requests = random_requests(load_stream(model_dir), options.num_requests, options.input_len_range,
                               options.output_len_range, options.seed)
    warmup_prompts = [p[:WARMUP_PROMPT_LEN] for p in requests.prompts[:WARMUP_REQUESTS]]
    case = Case(LABEL, requests.prompts, requests.output_lens, warmup_prompts,
                [WARMUP_OUTPUT_LEN] * len(warmup_prompts))
    max_seq_len = max(len(p) + n for p, n in zip(requests.prompts, requests.output_lens))
    factory = SystemFactory(model_dir, options.dtype, max_requests=options.num_requests, max_seq_len=max_seq_len,
                            static_batch_size=options.batch_size)
    records = run_systems(factory, list(options.systems), [case], options.reps, log)
    return random_report(options, model_dir, case, records)


def random_report(options: BenchOptions, model_dir: str, case: Case, records: dict[str, SystemRecord]) -> dict:
    prompt_tokens = sum(len(p) for p in case.prompts)
    systems = {}
    for name, record in records.items():
        runs = [_run_metrics(run, prompt_tokens) for run in record.runs.get(LABEL, [])]
        summary = None
        if runs:
            summary = {key: summarize([run[key] for run in runs])
                       for key in ("output_tok_s", "total_tok_s", "latency_p50_s", "latency_p99_s")}
        systems[name] = {"reason": record.reason, "runs": runs, "summary": summary}
    base = (systems.get(BASELINE) or {}).get("summary")
    for system in systems.values():
        if system["summary"] is not None:
            system["summary"]["speedup_vs_hf_generate"] = (
                system["summary"]["output_tok_s"]["median"] / base["output_tok_s"]["median"] if base else None)
    config = {"model": model_dir, "dtype": options.dtype, "systems": list(options.systems), "reps": options.reps,
              "num_requests": options.num_requests, "input_len_range": list(options.input_len_range),
              "output_len_range": list(options.output_len_range), "hf_generate_batch_size": options.batch_size,
              "seed": options.seed, "prompt_source": PROMPT_SOURCE}
    return {"workload": "random", "config": config,
            "requests": {"prompt_tokens": prompt_tokens, "output_tokens": sum(case.output_lens),
                         "input_lens": [len(p) for p in case.prompts], "output_lens": list(case.output_lens)},
            "systems": systems}


def _run_metrics(run: RunResult, prompt_tokens: int) -> dict:
    return {"wall_s": run.wall_s, "output_tokens": run.output_tokens,
            "output_tok_s": run.output_tokens / run.wall_s,
            "total_tok_s": (prompt_tokens + run.output_tokens) / run.wall_s,
            "latency_p50_s": percentile(run.finish_s, 50), "latency_p99_s": percentile(run.finish_s, 99),
            "latencies_s": list(run.finish_s)}


def random_table(report: dict) -> str:
    config, requests = report["config"], report["requests"]
    lines = [f"{config['model']} ({config['dtype']}), {config['num_requests']} requests submitted at once: "
             f"{requests['prompt_tokens']} prompt + {requests['output_tokens']} output tokens "
             f"(input lengths U{config['input_len_range']}, output U{config['output_len_range']}, seed "
             f"{config['seed']}); hf-generate runs static batches of {config['hf_generate_batch_size']}, "
             f"{config['reps']} reps", describe_machine(report["machine"]), ""]
    rows = []
    for name, system in report["systems"].items():
        summary = system["summary"]
        if summary is None:
            continue
        speedup = summary["speedup_vs_hf_generate"]
        rows.append([name, f"{summary['output_tok_s']['median']:.1f}", f"{summary['total_tok_s']['median']:.1f}",
                     f"{summary['latency_p50_s']['median']:.2f}", f"{summary['latency_p99_s']['median']:.2f}",
                     f"{speedup:.2f}x" if speedup is not None else "-"])
    lines.append(format_table(["system", "output tok/s", "total tok/s", "p50 latency s", "p99 latency s",
                               "vs hf-generate"], rows))
    lines += [f"{name}: skipped ({system['reason']})" for name, system in report["systems"].items()
              if system["reason"] is not None]
    return "\n".join(lines)
