"""One `mini-infer bench` invocation: run the chosen workload, print its table, write its table, JSON and PNG."""

from __future__ import annotations

import sys
import time

from mini_infer.bench.charts import chart
from mini_infer.bench.features import LONG_PROMPT, SHARED_PREFIX
from mini_infer.bench.kl import KL
from mini_infer.bench.matmul import MATMUL
from mini_infer.bench.overheads import PARALLEL_SAMPLING, STRUCTURED_OUTPUTS
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import NANO_VLLM_HIGH
from mini_infer.bench.parallel import PARALLEL
from mini_infer.bench.report import Workload, describe_machine, format_table, machine_info, versions, write_json
from mini_infer.bench.serving import SERVING
from mini_infer.bench.speculative import SPECULATIVE_DRAFT, SPECULATIVE_NGRAM
from mini_infer.bench.throughput import FIXED, NANO_VLLM, PREFILL, RANDOM
from mini_infer.config import ModelConfig
from mini_infer.kernels.autotune import describe_choices

WORKLOADS = {  # one per options.WORKLOADS name
    "fixed": FIXED, "prefill": PREFILL, "random": RANDOM, "nano-vllm": NANO_VLLM, "parallel": PARALLEL,
    "shared-prefix": SHARED_PREFIX, "long-prompt": LONG_PROMPT, "kl": KL, "structured-outputs": STRUCTURED_OUTPUTS,
    "parallel-sampling": PARALLEL_SAMPLING, "matmul": MATMUL, "serving": SERVING,
    "speculative-draft": SPECULATIVE_DRAFT, "speculative-ngram": SPECULATIVE_NGRAM}


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(options: BenchOptions, model_dir: str) -> None:
    """Run the workload, print its table, and write <workload>.txt, .json and .png into options.out."""
    _check_lengths(options, model_dir)
    options.out.mkdir(parents=True, exist_ok=True)
    workload = WORKLOADS[options.workload]
    header = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(options.device),
              "versions": versions()}
    report = {**header, **workload.run(options, model_dir, _log)}
    stem = options.out / options.workload
    write_json(stem.with_suffix(".json"), report)
    chart(stem.with_suffix(".png"), *workload.chart(report))
    text = table(workload, report)
    stem.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"\nwrote {stem}.txt, .json and .png")


def table(workload: Workload, report: dict) -> str:
    """The headline with the machine's line after its first line, the table, how each system was set up (a peer's
    versions, mini-infer's kernels and the autotuner's matmul choices), and the systems that were skipped."""
    lines = workload.headline(report)
    lines.insert(1, describe_machine(report["machine"]))
    systems = report.get("systems", {})
    setups = []
    for name, system in systems.items():
        setup = system.get("setup") or {}
        if "summary" in setup:
            setups.append(f"{name}: {setup['summary']}")
        if setup.get("matmul_choices"):
            setups += [f"{name} matmul per weight shape and batch-size bucket (autotuned):",
                       *(f"  {line}" for line in describe_choices(setup["matmul_choices"]))]
    skipped = [f"{name}: skipped ({system['reason']})" for name, system in systems.items()
               if system["reason"] is not None]
    return "\n".join([*lines, "", format_table(workload.columns, workload.rows(report)), *setups, *skipped])


def _check_lengths(options: BenchOptions, model_dir: str) -> None:
    limit = ModelConfig.from_dir(model_dir).max_position_embeddings
    longest = {"fixed": ("--prompt-len + --max-new-tokens", options.prompt_len + options.max_new_tokens),
               "prefill": ("--prompt-len + 1", options.prompt_len + 1),
               "parallel": ("--prompt-len + --parallel-new-tokens", options.prompt_len + options.parallel_new_tokens),
               "random": ("the longest request (--input-len-range HIGH + --output-len-range HIGH)",
                          options.input_len_range[1] + options.output_len_range[1]),
               "nano-vllm": ("nano-vllm's longest request", NANO_VLLM_HIGH + NANO_VLLM_HIGH),
               "structured-outputs": ("--prompt-len + --max-new-tokens", options.prompt_len + options.max_new_tokens),
               "parallel-sampling": ("--prompt-len + --max-new-tokens", options.prompt_len + options.max_new_tokens),
               "speculative-draft": ("--prompt-len + --max-tokens + the largest of --ks",
                                     options.prompt_len + options.max_tokens + max(options.ks)),
               }.get(options.workload)
    if longest is not None and longest[1] > limit:
        raise ValueError(f"{longest[0]} must be <= {limit} (the model's max_position_embeddings), got {longest[1]}")
