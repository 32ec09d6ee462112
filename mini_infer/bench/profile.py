"""`mini-infer profile`: where the time of one decode step at batch B goes, from the engine's record_function
ranges (input_prep, forward with kv_write / attention / lm_head, sampling, scheduler)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mini_infer.bench.report import Column, format_table
from mini_infer.engine.arg_utils import EngineArgs
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels.autotune import describe_choices
from mini_infer.sampling_params import RequestOutputKind, SamplingParams

# Ranges the engine labels; "forward" encloses kv_write, attention, decoder_layers, moe_routing, experts and lm_head,
# the rest are disjoint. A decode-only step runs all its layers in one native call (decoder_layers: norms, matmuls,
# RoPE/KV write, attention, SiLU); kv_write and attention are the layers run op by op (prefill, tensor parallel, a
# mixture of experts); moe_routing and experts a sparse layer's router (with the grouping of its tokens by expert)
# and its experts' MLPs.
_LABELS = ("scheduler", "input_prep", "forward", "kv_write", "attention", "decoder_layers", "moe_routing", "experts",
           "lm_head", "sampling")
_FORWARD_PARTS = ("kv_write", "attention", "decoder_layers", "moe_routing", "experts")
ROWS = ("input preparation", "KV write", "attention", "decoder layers (one native call)", "MoE routing", "experts",
        "rest of forward", "LM head", "sampling", "scheduler / bookkeeping", "other")
SAMPLING = ("greedy", "model-defaults")
OTHER = "other"  # the step time no labelled range covers: the remainder, not a measurement
COLUMNS = (Column("component", "name"), Column("ms/step", "ms", "{:.3f}"), Column("% step", "percent", "{:.1f}%"))


def add_profile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `profile` subcommand's options plus the engine's."""
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--decode-steps-before", type=int, default=64,
                        help="decode steps run before timing, so the context is realistic")
    parser.add_argument("--steps", type=int, default=5, help="decode steps measured (the mean is reported)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="the profiled requests' repetition penalty (> 0; 1.0: none, plain greedy)")
    parser.add_argument("--sampling", choices=SAMPLING, default="greedy",
                        help="greedy (with --repetition-penalty), or model-defaults: the sampling parameters of the "
                             "model's generation_config.json, which every request that sets none gets")
    parser.add_argument("--out", default=None, help="directory for profile.json and profile.txt")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace (trace.json) to --out")
    EngineArgs.add_cli_args(parser)
    return parser


def run_profile(args: argparse.Namespace) -> int:
    """Build the engine from the parsed flags, profile its decode step, print the table (and write --out)."""
    if args.trace and args.out is None:
        raise ValueError("--trace needs --out (the directory the trace is written to)")
    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size: profile breaks down the decode step of one replica (on rank 0 "
                         "with tensor/pipeline parallelism); run it with --data-parallel-size 1")
    if not args.repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.sampling == "model-defaults" and args.repetition_penalty != 1.0:
        raise ValueError("--repetition-penalty applies to --sampling greedy; model-defaults takes the model's")
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    out_dir = Path(args.out) if args.out is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    result = profile_decode_step(engine, args.batch_size, prompt_len=args.prompt_len,
                                 decode_steps_before=args.decode_steps_before, steps=args.steps,
                                 repetition_penalty=args.repetition_penalty, sampling=args.sampling,
                                 trace_path=out_dir / "trace.json" if args.trace else None)
    table = profile_table(result)
    print(table)
    if out_dir is not None:
        (out_dir / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
        (out_dir / "profile.txt").write_text(table + "\n")
    return 0


def profile_decode_step(engine, batch_size: int, *, prompt_len: int = 32, decode_steps_before: int = 64,
                        steps: int = 5, repetition_penalty: float = 1.0, sampling: str = "greedy",
                        trace_path: Path | None = None) -> dict:
    """Bring `batch_size` requests into decode, time `steps` decode steps plain and then under the profiler,
    and return the per-step breakdown (ms and % of the profiled step). The requests are aborted after."""
    for name, value, low in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1),
                             ("decode_steps_before", decode_steps_before, 0), ("steps", steps, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    max_tokens = 1 + decode_steps_before + 2 * steps
    base = (engine.default_sampling_params() if sampling == "model-defaults"
            else SamplingParams(temperature=0, repetition_penalty=repetition_penalty))
    params = replace(base, ignore_eos=True, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    batch = _DecodeBatch(engine, batch_size, prompt_len, params)
    try:
        for _ in range(decode_steps_before):
            batch.step()
        with _HostTimes(engine) as host:
            unprofiled = [batch.step() for _ in range(steps)]
        context_len = batch.context_len()
        on_gpu = engine.config.device != "cpu"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
        with profile(activities=activities) as prof:
            profiled = [batch.step() for _ in range(steps)]
    finally:
        batch.release()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    step_ms = 1000 * statistics.fmean(profiled)
    rows = _component_rows(_label_totals_ms(prof.events(), steps), step_ms)
    config, stats = engine.config, engine.memory_stats()[0]
    gpu = _gpu_work(prof.events(), steps, config.model_config.num_hidden_layers) if on_gpu else None
    return {
        "gpu": gpu, "decode_graphs": stats.get("decode_graphs"),
        "kernels": stats["kernels"], "matmul_choices": stats["matmul_choices"],
        "model": str(config.model), "dtype": str(config.torch_dtype).removeprefix("torch."),
        "device": str(config.device), "batch_size": batch_size, "prompt_len": prompt_len,
        "decode_steps_before": decode_steps_before, "context_len": context_len, "steps": steps,
        "repetition_penalty": params.repetition_penalty, "sampling": sampling,
        "sampling_params": {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "min_p")},
        "step_ms": step_ms,
        "unprofiled_step_ms": 1000 * statistics.fmean(unprofiled),
        "host_ms": host.per_step_ms(steps),
        "measured_ms": sum(row["ms"] for row in rows if row["name"] != OTHER), "rows": rows,
    }


class _DecodeBatch:
    """The profiled requests in an LLMEngine: the one place that reads the engine's internals (its requests,
    scheduler queues and KV cache), to check that every timed step is a decode step of all of them."""

    def __init__(self, engine, batch_size: int, prompt_len: int, params: SamplingParams):
        max_tokens = params.max_tokens
        if batch_size > engine.config.max_num_seqs:
            raise ValueError(f"batch_size ({batch_size}) exceeds max_num_seqs ({engine.config.max_num_seqs}); "
                             "raise --max-num-seqs")
        kv = engine.kv_cache
        needed = batch_size * kv.blocks_for(prompt_len + max_tokens)
        if needed > kv.num_blocks:
            raise ValueError(f"{batch_size} requests of {prompt_len} prompt tokens decoding {max_tokens} tokens "
                             f"need {needed} KV blocks but the cache has {kv.num_blocks}; raise --num-kv-blocks / "
                             "--kv-cache-memory-gb or shrink the batch")
        if engine.has_unfinished_requests():
            raise ValueError("profile needs an idle engine; this one has unfinished requests")
        self.engine, self.scheduler = engine, engine.scheduler
        vocab = engine.config.model_config.vocab_size
        self.ids = [f"profile-{i}" for i in range(batch_size)]
        for i, request_id in enumerate(self.ids):
            engine.add_request(request_id, [(1000 + 7919 * i + 31 * j) % vocab for j in range(prompt_len)], params)
        self.requests = [engine.requests[request_id] for request_id in self.ids]
        for _ in range(batch_size):  # each prefill step admits at least one request unless something is too small
            if not self.scheduler.waiting:
                break
            engine.step()
        # (each has sampled its first token, or has it on the way: with async scheduling a step's tokens come in
        # with the next step)
        if self.scheduler.waiting or any(r.num_output_tokens + r.num_pending != 1 for r in self.requests):
            self.release()
            raise ValueError(f"could not bring all {batch_size} requests into the decode phase together; "
                             "raise --num-kv-blocks / --kv-cache-memory-gb or --max-num-batched-tokens")

    def context_len(self) -> int:
        """The positions the next decode step attends to (its token's among them)."""
        return self.requests[0].num_computed_tokens + 1

    def step(self) -> float:
        """One engine step, checked to be a decode step of exactly these requests; returns its wall time (s)."""
        scheduler, count = self.scheduler, len(self.requests)
        if scheduler.waiting or len(scheduler.running) != count:
            raise ValueError(f"expected a decode step of {count} requests but {len(scheduler.running)} are "
                             f"running and {len(scheduler.waiting)} waiting (is the KV cache too small?)")
        before, preemptions = [r.num_output_tokens for r in self.requests], scheduler.num_preemptions
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        if scheduler.num_preemptions != preemptions or any(r.num_output_tokens != n + 1
                                                            for r, n in zip(self.requests, before)):
            raise ValueError(f"a step was not a decode step of all {count} requests "
                             "(a request was preempted: the KV cache is too small)")
        return elapsed

    def release(self) -> None:
        self.engine.abort_request(self.ids)
        self.engine.step()  # hands back the abort outputs, leaving the engine idle


class _HostTimes:
    """Wall time of the engine's host work in the unprofiled steps, by part (the profiler's per-op recording would
    inflate exactly this Python work): schedule and update (the scheduler's), the outputs (the engine's), the input
    preparation (rank 0's runner). Each method is wrapped on its instance for the steps, then restored."""

    PARTS = (("schedule", "scheduler", "schedule"), ("input_prep", "runner", "prepare"),
             ("update", "scheduler", "update"), ("outputs", "engine", "_outputs"))

    def __init__(self, engine):
        self._owners = {"engine": engine, "scheduler": engine.scheduler, "runner": engine.runner}
        self.seconds = dict.fromkeys((part for part, _, _ in self.PARTS), 0.0)

    def __enter__(self) -> _HostTimes:
        for part, owner, name in self.PARTS:
            setattr(self._owners[owner], name, self._timed(part, getattr(self._owners[owner], name)))
        return self

    def __exit__(self, *exc) -> None:
        for _, owner, name in self.PARTS:
            del self._owners[owner].__dict__[name]  # (the class's method again)

    def _timed(self, part: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        return timed

    def per_step_ms(self, steps: int) -> dict[str, float]:
        per_step = {part: 1000 * seconds / steps for part, seconds in self.seconds.items()}
        return {**per_step, "total": sum(per_step.values())}


def _gpu_work(events, steps: int, num_layers: int) -> dict:
    """What the device ran per step: its kernels (those a CUDA graph replays included) and copies, their count and
    summed time, and the kernels per decoder layer (all of a step's over its layers: the LM head and sampler's few
    included)."""
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.startswith("Memcpy") or event.name.startswith("Memset"):
            copies, copy_us = copies + 1, copy_us + event.device_time_total
        else:
            kernels, kernel_us = kernels + 1, kernel_us + event.device_time_total
    return {"kernels_per_step": kernels / steps, "kernel_ms_per_step": kernel_us / 1000 / steps,
            "kernels_per_layer": kernels / steps / max(1, num_layers), "copies_per_step": copies / steps,
            "copy_ms_per_step": copy_us / 1000 / steps}


def _label_totals_ms(events, steps: int) -> dict[str, float]:
    """Mean ms per step of every labelled range, summed over its occurrences (one per layer for kv_write and
    attention, two per step for scheduler); each occurrence counts its whole span, children included."""
    totals = dict.fromkeys(_LABELS, 0.0)
    for event in events:
        if event.name in totals:
            totals[event.name] += event.cpu_time_total / 1000
    return {label: total / steps for label, total in totals.items()}


def _component_rows(label_ms: dict[str, float], step_ms: float) -> list[dict]:
    """The measured ranges (forward split into its labelled parts and the rest), then OTHER: the step time
    they leave uncovered."""
    forward_parts = sum(label_ms[label] for label in _FORWARD_PARTS) + label_ms["lm_head"]
    measured = (label_ms["input_prep"], *(label_ms[label] for label in _FORWARD_PARTS),
                label_ms["forward"] - forward_parts,
                label_ms["lm_head"], label_ms["sampling"], label_ms["scheduler"])
    values = (*measured, step_ms - sum(measured))
    return [{"name": name, "ms": ms, "percent": 100 * ms / step_ms} for name, ms in zip(ROWS, values)]


def _host_line(host: dict[str, float], step_ms: float) -> str:
    names = {"schedule": "schedule", "input_prep": "input preparation", "update": "update", "outputs": "outputs"}
    return (f"host work without the profiler: {host['total']:.3f} ms/step ({100 * host['total'] / step_ms:.1f}% of the "
            f"step; {', '.join(f'{label} {host[part]:.3f}' for part, label in names.items())})")


def profile_table(result: dict) -> str:
    """The breakdown with the run's settings and the profiler-overhead caveat."""
    penalty, chosen = result["repetition_penalty"], result["sampling_params"]
    head = (f"decode step: batch {result['batch_size']}, context {result['context_len']} tokens, "
            f"{result['dtype']} on {result['device']}, mean of {result['steps']} steps"
            + (f", the model's sampling defaults ({', '.join(f'{k} {v:g}' for k, v in chosen.items())})"
               if result["sampling"] == "model-defaults" else "")
            + (f", repetition penalty {penalty:g}" if penalty != 1.0 else ""))
    total = {"name": "step total", "ms": result["step_ms"], "percent": 100.0}
    lines = [head, "", format_table(COLUMNS, [*result["rows"], None, total]), "",
             f"{OTHER}: the step time outside the labelled ranges (step total minus the rows above it)",
             f"without the profiler: {result['unprofiled_step_ms']:.3f} ms/step (the profiler's per-op recording "
             "adds the difference; read the rows as shares of the step)",
             _host_line(result["host_ms"], result["unprofiled_step_ms"])]
    if result["device"] != "cpu":
        lines.append("the rows are host-side ranges: the GPU's asynchronous work counts where the host waits for it")
        gpu = result["gpu"]
        lines.append(f"on the GPU a step: {gpu['kernels_per_step']:.0f} kernels ({gpu['kernels_per_layer']:.1f} per "
                     f"decoder layer) busy {gpu['kernel_ms_per_step']:.3f} ms, {gpu['copies_per_step']:.0f} copies "
                     f"{gpu['copy_ms_per_step']:.3f} ms")
        graphs = result["decode_graphs"]
        lines.append(f"decode steps replay CUDA graphs ({len(graphs['sizes'])} batch sizes up to "
                     f"{graphs['sizes'][-1]}, captured in {graphs['capture_s']:.1f} s)" if graphs
                     else "every step runs eagerly (no graphs)")
    lines.append(f"kernels: {result['kernels']}")
    if result["matmul_choices"]:
        lines += ["matmul per weight shape and batch-size bucket (autotuned):",
                  *(f"  {line}" for line in describe_choices(result["matmul_choices"]))]
    return "\n".join(lines)
