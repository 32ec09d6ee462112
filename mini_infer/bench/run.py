"""One `mini-infer bench` invocation: run the chosen workload, print its table, write its JSON and PNG."""

from __future__ import annotations

import sys
import time

from mini_infer.bench import charts
from mini_infer.bench.features import long_prompt_table, run_long_prompt, run_shared_prefix, shared_prefix_table
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.parallel import parallel_table, run_parallel
from mini_infer.bench.report import machine_info, versions, write_json
from mini_infer.bench.throughput import fixed_table, run_fixed
from mini_infer.bench.workload import random_table, run_random
from mini_infer.config import ModelConfig

WORKLOADS = {  # name -> (run, table, chart)
    "fixed": (run_fixed, fixed_table, charts.throughput_chart),
    "random": (run_random, random_table, charts.workload_chart),
    "parallel": (run_parallel, parallel_table, charts.parallel_chart),
    "shared-prefix": (run_shared_prefix, shared_prefix_table, charts.feature_chart),
    "long-prompt": (run_long_prompt, long_prompt_table, charts.feature_chart),
}


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(options: BenchOptions, model_dir: str) -> None:
    """Run the workload, print its table, and write <workload>.json and <workload>.png into options.out."""
    _check_lengths(options, model_dir)
    options.out.mkdir(parents=True, exist_ok=True)
    run, table, chart = WORKLOADS[options.workload]
    header = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), "versions": versions()}
    report = {**header, **run(options, model_dir, _log)}
    json_path, png_path = options.out / f"{options.workload}.json", options.out / f"{options.workload}.png"
    write_json(json_path, report)
    chart(report, png_path)
    print(table(report))
    print(f"\nwrote {json_path} and {png_path}")


def _check_lengths(options: BenchOptions, model_dir: str) -> None:
    limit = ModelConfig.from_dir(model_dir).max_position_embeddings
    if options.workload == "fixed" and options.prompt_len + options.max_new_tokens > limit:
        raise ValueError(f"--prompt-len + --max-new-tokens must be <= {limit} (the model's "
                         f"max_position_embeddings), got {options.prompt_len + options.max_new_tokens}")
    if options.workload == "parallel" and options.prompt_len + options.parallel_new_tokens > limit:
        raise ValueError(f"--prompt-len + --parallel-new-tokens must be <= {limit} (the model's "
                         f"max_position_embeddings), got {options.prompt_len + options.parallel_new_tokens}")
    if options.workload == "random" and options.input_len_range[1] + options.output_len_range[1] > limit:
        raise ValueError(f"the longest request (--input-len-range HIGH + --output-len-range HIGH) must be <= "
                         f"{limit} (the model's max_position_embeddings)")
