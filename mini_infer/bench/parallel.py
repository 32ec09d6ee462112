"""The multi-device workload (`bench --parallel single,dp2,tp2,pp2`): one batch of real-text prompts decoded by
each layout; output tokens/s and per rank parameter bytes, KV bytes and peak memory (resident set on the CPU,
CUDA's max allocated on a GPU).

Each layout runs in a fresh process, so that rank 0's peak resident set is its own and not an earlier layout's.
The KV cache is sized to the batch (not the default budget), so its bytes per rank show how the layout splits it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions, parse_layout
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import Column, Workload, speedup, summarize
from mini_infer.bench.systems import MiniInferSystem

BLOCK_SIZE = 16


def run_parallel(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    batch, new_tokens = options.parallel_batch_size, options.parallel_new_tokens
    prompts = fixed_prompts(load_stream(model_dir), batch, options.prompt_len)
    num_kv_blocks = batch * (-(-(options.prompt_len + new_tokens) // BLOCK_SIZE) + 1)
    engine_args = dict(dtype=options.dtype, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks, max_num_seqs=batch)
    layouts = []
    for name in options.parallel:
        sizes = parse_layout(name)
        num_ranks = math.prod(sizes.values())
        log(f"{name}: starting {num_ranks} rank(s) in a fresh process")
        result = _in_fresh_process(_measure, model_dir, {**engine_args, **sizes}, prompts, new_tokens,
                                   min(options.warmup_tokens, new_tokens), options.reps)
        tok_s = [run["output_tokens"] / run["wall_s"] for run in result["runs"]]
        for rep, rate in enumerate(tok_s):
            log(f"{name} rep {rep + 1}/{options.reps}: {rate:.1f} output tok/s")
        layouts.append({"name": name, "sizes": sizes, "num_ranks": num_ranks, "runs": result["runs"],
                        "tok_s": summarize(tok_s), "ranks": result["ranks"]})
    base = next((lay["tok_s"]["median"] for lay in layouts if lay["name"] == "single"), None)
    for lay in layouts:
        lay["vs_single"] = speedup(lay["tok_s"]["median"], base)
    config = {"model": model_dir, "dtype": options.dtype, "parallel": list(options.parallel), "reps": options.reps,
              "batch_size": batch, "prompt_len": options.prompt_len, "max_new_tokens": new_tokens,
              "warmup_tokens": options.warmup_tokens, "num_kv_blocks": num_kv_blocks, "block_size": BLOCK_SIZE}
    return {"workload": "parallel", "config": config, "layouts": layouts}


def _measure(model_dir: str, engine_args: dict, prompts: list[list[int]], new_tokens: int, warmup_tokens: int,
             reps: int) -> dict:
    system = MiniInferSystem(model_dir, engine_args)
    try:
        system.run(prompts, [warmup_tokens] * len(prompts))
        runs = [system.run(prompts, [new_tokens] * len(prompts)) for _ in range(reps)]
        return {"runs": [{"wall_s": run.wall_s, "output_tokens": run.output_tokens} for run in runs],
                "ranks": system.engine.memory_stats()}
    finally:
        system.close()


def _in_fresh_process(function, *args):
    """function(*args) in a new (spawned) process; its result, or its error re-raised here."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(target=_call, args=(theirs, function, args))  # not daemonic: it starts ranks
    process.start()
    theirs.close()
    try:
        ok, value = ours.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"the measuring process exited with code {process.exitcode} before reporting") from None
    process.join()
    if not ok:
        raise RuntimeError(f"the measuring process failed: {value}")
    return value


def _call(conn, function, args) -> None:
    try:
        conn.send((True, function(*args)))
    except Exception as e:  # noqa: BLE001 - re-raised in the parent
        conn.send((False, f"{type(e).__name__}: {e}"))


def _rank_row(rank: dict) -> dict:
    """r<rank> (dp<replica>.r<rank> in a data-parallel replica), and its peak as CUDA's max allocated on a GPU,
    else the peak resident set."""
    peak = ("peak_alloc", rank["cuda_max_allocated_bytes"]) if "cuda_max_allocated_bytes" in rank else \
        ("peak_rss", rank["peak_rss_bytes"])
    label = f"dp{rank['replica']}.r{rank['rank']}" if "replica" in rank else f"r{rank['rank']}"
    return {"rank": label, "param_bytes": rank["param_bytes"], "kv_bytes": rank["kv_bytes"], peak[0]: peak[1],
            "peak_bytes": peak[1]}


def _parallel_rows(report: dict) -> list[dict]:
    """A row per rank, the layout's throughput on its first."""
    return [{**({"layout": lay["name"], "num_ranks": lay["num_ranks"], "tok_s": lay["tok_s"],
                 "vs_single": lay["vs_single"]} if i == 0 else {}), **_rank_row(rank)}
            for lay in report["layouts"] for i, rank in enumerate(lay["ranks"])]


def _parallel_chart(report: dict) -> tuple[str, list[Panel]]:
    """Output tokens/s per layout, beside each rank's parameter bytes and peak memory."""
    layouts, config, rows = report["layouts"], report["config"], _parallel_rows(report)
    labels = [f"{lay['name']}\n{_rank_row(rank)['rank']}" for lay in layouts for rank in lay["ranks"]]
    memory = [Series(label, [row[key] / 1e6 for row in rows])
              for label, key in (("parameters", "param_bytes"), ("peak memory", "peak_bytes"))]
    return (f"parallel layouts: batch {config['batch_size']}, {config['max_new_tokens']} new tokens, "
            f"{Path(config['model']).name}, {config['dtype']}",
            [Panel("output tokens / s", [lay["name"] for lay in layouts],
                   [Series.spread("tok/s", [lay["tok_s"] for lay in layouts])]),
             Panel("MB per rank", labels, memory, width=2, fontsize=7)])


HEADLINE = ("{model} ({dtype}), batch {batch_size}, {prompt_len} prompt + {max_new_tokens} new tokens per request, "
            "{reps} reps; KV cache {num_kv_blocks} blocks of {block_size}")
PARALLEL = Workload(run_parallel, lambda report: [HEADLINE.format_map(report["config"])], (
    Column("layout", "layout"), Column("ranks", "num_ranks"), Column("tok/s", "tok_s", "{0[median]:.1f}"),
    Column("min-max", "tok_s", "{0[min]:.1f}-{0[max]:.1f}"), Column("vs single", "vs_single", "{:.2f}x"),
    Column("rank", "rank"), Column("params MB", "param_bytes", "{:.0f}", 1e-6),
    Column("KV MB", "kv_bytes", "{:.1f}", 1e-6), Column("peak alloc MB", "peak_alloc", "{:.0f}", 1e-6),
    Column("peak RSS MB", "peak_rss", "{:.0f}", 1e-6)), _parallel_rows, _parallel_chart)
