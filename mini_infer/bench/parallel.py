"""The multi-device workload (`mini-infer bench --parallel single,dp2,tp2,pp2`): one batch of real-text prompts
decoded by each parallel layout; output tokens/s and, per rank, parameter bytes, KV bytes and peak memory (the
peak resident set on the CPU, CUDA's max allocated on a GPU).

Each layout runs in a fresh process, so that rank 0's peak resident set is its own and not an earlier layout's.
The KV cache is sized to the batch (not the default budget), so its bytes per rank show how the layout splits it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.multiprocessing as mp

from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import describe_machine, format_table, summarize
from mini_infer.bench.systems import MiniInferSystem

_SIZES = {"dp": "data_parallel_size", "tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
_MODE = re.compile(r"(?:(?:dp|tp|pp)[1-9]\d*)+")


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    sizes: dict  # EngineConfig parallel fields that differ from 1

    @property
    def num_ranks(self) -> int:
        ranks = 1
        for size in self.sizes.values():
            ranks *= size
        return ranks


def parse_layout(name: str) -> Layout:
    """`single`, or sizes such as dp2, tp2, pp2, tp2pp2."""
    if name == "single":
        return Layout(name, {})
    if not _MODE.fullmatch(name):
        raise ValueError(f"--parallel takes 'single' or sizes like dp2, tp2, pp2, tp2pp2; got {name!r}")
    sizes = {}
    for kind, size in re.findall(r"(dp|tp|pp)(\d+)", name):
        if _SIZES[kind] in sizes:
            raise ValueError(f"--parallel: {name!r} gives {kind} twice")
        sizes[_SIZES[kind]] = int(size)
    return Layout(name, sizes)


def run_parallel(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream = load_stream(model_dir)
    batch, new_tokens = options.parallel_batch_size, options.parallel_new_tokens
    prompts = fixed_prompts(stream, batch, options.prompt_len)
    block_size = 16
    num_kv_blocks = batch * (-(-(options.prompt_len + new_tokens) // block_size) + 1)
    engine_args = dict(dtype=options.dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                       max_num_seqs=batch)
    layouts = []
    for name in options.parallel:
        layout = parse_layout(name)
        log(f"{name}: starting {layout.num_ranks} rank(s) in a fresh process")
        result = _in_fresh_process(_measure, model_dir, {**engine_args, **layout.sizes}, prompts, new_tokens,
                                   min(options.warmup_tokens, new_tokens), options.reps)
        tok_s = [run["output_tokens"] / run["wall_s"] for run in result["runs"]]
        for rep, rate in enumerate(tok_s):
            log(f"{name} rep {rep + 1}/{options.reps}: {rate:.1f} output tok/s")
        layouts.append({"name": name, "sizes": layout.sizes, "num_ranks": layout.num_ranks,
                        "runs": result["runs"], "tok_s": summarize(tok_s), "ranks": result["ranks"]})
    base = next((lay["tok_s"]["median"] for lay in layouts if lay["name"] == "single"), None)
    for lay in layouts:
        lay["vs_single"] = lay["tok_s"]["median"] / base if base else None
    config = {"model": model_dir, "dtype": options.dtype, "parallel": list(options.parallel), "reps": options.reps,
              "batch_size": batch, "prompt_len": options.prompt_len, "max_new_tokens": new_tokens,
              "warmup_tokens": options.warmup_tokens, "num_kv_blocks": num_kv_blocks, "block_size": block_size}
    return {"workload": "parallel", "config": config, "layouts": layouts}


def _measure(model_dir: str, engine_args: dict, prompts: list[list[int]], new_tokens: int, warmup_tokens: int,
             reps: int) -> dict:
    system = MiniInferSystem(model_dir, engine_args)
    try:
        system.run(prompts, [warmup_tokens] * len(prompts))
        runs = []
        for _ in range(reps):
            result = system.run(prompts, [new_tokens] * len(prompts))
            runs.append({"wall_s": result.wall_s, "output_tokens": result.output_tokens})
        return {"runs": runs, "ranks": system.llm.engine.memory_stats()}
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


def rank_label(rank: dict) -> str:
    """r<rank>, or dp<replica>.r<rank> for a rank of a data-parallel replica."""
    return f"dp{rank['replica']}.r{rank['rank']}" if "replica" in rank else f"r{rank['rank']}"


def peak_bytes(rank: dict) -> int:
    """CUDA's max allocated on a GPU, else the peak resident set."""
    return rank.get("cuda_max_allocated_bytes", rank["peak_rss_bytes"])


def parallel_table(report: dict) -> str:
    config = report["config"]
    lines = [f"{config['model']} ({config['dtype']}), batch {config['batch_size']}, {config['prompt_len']} prompt + "
             f"{config['max_new_tokens']} new tokens per request, {config['reps']} reps; KV cache "
             f"{config['num_kv_blocks']} blocks of {config['block_size']}", describe_machine(report["machine"]), ""]
    rows = []
    for lay in report["layouts"]:
        tok_s, vs = lay["tok_s"], lay["vs_single"]
        for i, rank in enumerate(lay["ranks"]):
            first = i == 0
            rows.append([lay["name"] if first else "", lay["num_ranks"] if first else "",
                         f"{tok_s['median']:.1f}" if first else "",
                         f"{tok_s['min']:.1f}-{tok_s['max']:.1f}" if first else "",
                         (f"{vs:.2f}x" if vs is not None else "-") if first else "",
                         rank_label(rank), f"{rank['param_bytes'] / 1e6:.0f}", f"{rank['kv_bytes'] / 1e6:.1f}",
                         f"{peak_bytes(rank) / 1e6:.0f}"])
    peak_name = "peak alloc MB" if any("cuda_max_allocated_bytes" in r for lay in report["layouts"]
                                       for r in lay["ranks"]) else "peak RSS MB"
    lines.append(format_table(["layout", "ranks", "tok/s", "min-max", "vs single", "rank", "params MB", "KV MB",
                               peak_name], rows))
    return "\n".join(lines)
