"""The workloads that price a request feature against the same work without it (mini-infer only, one engine, the
settings' reps interleaved): structured-outputs (B greedy requests with a constraint against the same batch without
one: the decode step and the host work a constraint adds) and parallel-sampling (one request of n = 4 completions
against 4 separate requests of the same prompt and seeds, which sample the same tokens)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import Column, Workload
from mini_infer.bench.systems import MiniInferSystem, greedy
from mini_infer.engine.scheduler import Scheduler
from mini_infer.runner.sampler import Sampler
from mini_infer.sampling_params import StructuredOutputsParams

# Constraints that cannot complete within the run, so that the constrained batches run the same steps as the plain one.
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json={
        "type": "object", "required": ["text"], "additionalProperties": False,
        "properties": {"text": {"type": "string", "minLength": 2000}}}, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-z ]{1500}"),
}
# What a constraint changes on the host: the scheduler filling the bitmask, the sampler applying it, and the update
# advancing each matcher by its token.
_HOST_WORK = ((Scheduler, "_grammar_bitmask"), (Sampler, "__call__"), (Scheduler, "update"))
GROUP_N, FIRST_SEED = 4, 7


class _Clock:
    """Seconds spent in the wrapped methods since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self, methods: tuple[tuple[type, str], ...]) -> Iterator[None]:
        originals = [(owner, name, getattr(owner, name)) for owner, name in methods]

        def wrap(function):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return timed
        try:
            for owner, name, function in originals:
                setattr(owner, name, wrap(function))
            yield
        finally:
            for owner, name, function in originals:
                setattr(owner, name, function)


def _decode_steps(engine, prompts: list[list[int]], params, clock: _Clock, tag: str) -> tuple[list[float], list[float]]:
    """Seconds of each step in which every request decodes, and of the timed host work in it."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, work = [], []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.requests.values())
        clock.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - start)
            work.append(clock.seconds)
    return steps, work


def run_structured_outputs(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    new_tokens, sizes = options.max_new_tokens, options.batch_sizes
    system = MiniInferSystem(model_dir, dict(dtype=options.dtype, max_num_seqs=max(sizes),
                                             max_model_len=options.prompt_len + new_tokens,
                                             enable_prefix_caching=False))
    engine, clock = system.engine, _Clock()
    prompts = fixed_prompts(load_stream(model_dir), max(sizes), options.prompt_len)
    runs = {"plain": greedy(new_tokens), **{name: replace(greedy(new_tokens), structured_outputs=constraint)
                                            for name, constraint in CONSTRAINTS.items()}}
    rows = []
    try:
        with clock.timing(_HOST_WORK):
            for name, params in runs.items():  # warm-up: kernels tuned, grammars compiled
                _decode_steps(engine, prompts[:1], replace(params, max_tokens=2), clock, f"warm-{name}")
            for batch in sizes:
                steps = {name: [] for name in runs}
                work = {name: [] for name in runs}
                for rep in range(options.reps):
                    for name in list(runs) if rep % 2 == 0 else list(reversed(runs)):
                        step, host = _decode_steps(engine, prompts[:batch], runs[name], clock, f"{name}-{batch}-{rep}")
                        steps[name].append(statistics.median(step))
                        work[name].append(statistics.median(host))
                        log(f"structured-outputs B={batch} {name} rep {rep + 1}: {1e3 * steps[name][-1]:.2f} ms/step")
                base, base_host = statistics.median(steps["plain"]), statistics.median(work["plain"])
                for name in runs:
                    step, host = statistics.median(steps[name]), statistics.median(work[name])
                    rows.append({"batch_size": batch, "constraint": name, "step_s_per_rep": steps[name],
                                 "step_s": step, "step_vs_plain_pct": 100 * (step / base - 1), "host_s": host,
                                 "host_extra_s": host - base_host, "host_extra_pct": 100 * (host - base_host) / base})
    finally:
        system.close()
    config = {"model": model_dir, "dtype": options.dtype, "batch_sizes": list(sizes), "prompt_len": options.prompt_len,
              "max_new_tokens": new_tokens, "reps": options.reps, "constraints": list(CONSTRAINTS)}
    return {"workload": "structured-outputs", "config": config, "rows": rows}


def run_parallel_sampling(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    new_tokens = options.max_new_tokens
    system = MiniInferSystem(model_dir, dict(dtype=options.dtype, max_num_seqs=2 * GROUP_N,
                                             max_model_len=options.prompt_len + new_tokens))
    engine = system.engine
    # A prompt of its own for every timed run (so that none finds another's blocks cached), the last for the check.
    prompts = fixed_prompts(load_stream(model_dir), 2 * options.reps + 1, options.prompt_len)
    params = replace(engine.default_sampling_params(), max_tokens=new_tokens, ignore_eos=True, seed=FIRST_SEED)

    def completions(prompt: list[int], grouped: bool) -> list[list[int]]:
        if grouped:
            engine.add_request("group", prompt, replace(params, n=GROUP_N))
        for i in range(0 if grouped else GROUP_N):
            engine.add_request(f"alone-{i}", prompt, replace(params, seed=FIRST_SEED + i))
        done = {o.request_id: o for o in engine.run_until_done() if o.finished}
        if grouped:
            return [c.token_ids for c in done["group"].outputs]
        return [done[f"alone-{i}"].outputs[0].token_ids for i in range(GROUP_N)]

    try:
        if completions(prompts[-1], True) != completions(prompts[-1], False):
            raise RuntimeError("parallel sampling: the group and the separate requests sampled different tokens")
        runs = {f"n={GROUP_N} (one request)": True, f"{GROUP_N} separate requests": False}
        measured = {name: {"wall_s": [], "computed": []} for name in runs}
        for rep in range(options.reps):
            for i, (name, grouped) in enumerate(runs.items()):
                queries, hits = engine.kv_cache.prefix_queries, engine.kv_cache.prefix_hits
                start = time.perf_counter()
                completions(prompts[2 * rep + i], grouped)
                measured[name]["wall_s"].append(time.perf_counter() - start)
                measured[name]["computed"].append((engine.kv_cache.prefix_queries - queries)
                                                  - (engine.kv_cache.prefix_hits - hits))
                log(f"parallel-sampling {name} rep {rep + 1}: {measured[name]['wall_s'][-1]:.2f} s")
    finally:
        system.close()
    base = statistics.median(measured[f"{GROUP_N} separate requests"]["wall_s"])
    rows = [{"how": name, "wall_s": {"median": statistics.median(m["wall_s"]), "min": min(m["wall_s"]),
                                     "max": max(m["wall_s"])},
             "output_tok_s": GROUP_N * new_tokens / statistics.median(m["wall_s"]),
             "prompt_tokens_computed": m["computed"][-1], "speedup": base / statistics.median(m["wall_s"])}
            for name, m in measured.items()]
    config = {"model": model_dir, "dtype": options.dtype, "n": GROUP_N, "prompt_len": options.prompt_len,
              "max_new_tokens": new_tokens, "reps": options.reps, "seeds": f"{FIRST_SEED}..{FIRST_SEED + GROUP_N - 1}"}
    return {"workload": "parallel-sampling", "config": config, "rows": rows}


def _structured_chart(report: dict) -> tuple[str, list[Panel]]:
    config, rows = report["config"], report["rows"]
    sizes = config["batch_sizes"]
    series = [Series(name, [1e3 * next(r["step_s"] for r in rows if r["batch_size"] == b and r["constraint"] == name)
                            for b in sizes]) for name in ("plain", *config["constraints"])]
    return (f"structured outputs: {Path(config['model']).name}, {config['dtype']}",
            [Panel("decode step (ms)", [f"B={b}" for b in sizes], series)])


def _parallel_chart(report: dict) -> tuple[str, list[Panel]]:
    rows = report["rows"]
    return (f"parallel sampling: {Path(report['config']['model']).name}, {report['config']['dtype']}",
            [Panel("wall s", [r["how"] for r in rows], [Series.spread("wall", [r["wall_s"] for r in rows])])])


STRUCTURED_HEADLINE = ("{model} ({dtype}), {prompt_len}-token prompts, {max_new_tokens} new tokens each (greedy, "
                       "EOS ignored; the constraints cannot complete, so every batch runs the same steps), {reps} reps "
                       "interleaved: the median decode step of each rep, then of the reps; host work: the bitmask, "
                       "the sampler and the update, timed")
PARALLEL_HEADLINE = ("{model} ({dtype}), one {prompt_len}-token prompt, {n} completions of {max_new_tokens} tokens "
                     "(seeds {seeds}, the model's sampling defaults), {reps} reps interleaved, a prompt of its own "
                     "each")
STRUCTURED_OUTPUTS = Workload(run_structured_outputs, lambda r: [STRUCTURED_HEADLINE.format_map(r["config"])], (
    Column("batch", "batch_size"), Column("constraint", "constraint"), Column("step ms", "step_s", "{:.2f}", 1e3),
    Column("vs plain", "step_vs_plain_pct", "{:+.1f}%"), Column("host ms", "host_s", "{:.3f}", 1e3),
    Column("host extra ms", "host_extra_s", "{:.3f}", 1e3), Column("of plain step", "host_extra_pct", "{:.2f}%")),
    lambda report: report["rows"], _structured_chart)
PARALLEL_SAMPLING = Workload(run_parallel_sampling, lambda r: [PARALLEL_HEADLINE.format_map(r["config"])], (
    Column("how", "how"), Column("median s", "wall_s", "{0[median]:.2f}"),
    Column("min-max s", "wall_s", "{0[min]:.2f}-{0[max]:.2f}"), Column("out tok/s", "output_tok_s", "{:.1f}"),
    Column("prompt tokens computed", "prompt_tokens_computed"), Column("speed-up", "speedup", "{:.2f}x")),
    lambda report: report["rows"], _parallel_chart)
