"""Structured-output overhead per decode step: a batch of B greedy requests with a constraint against the same
batch without one, side by side in one process, reps interleaved (plain first in even reps, constrained first in
odd ones).

    .venv/bin/python scripts/bench_structured_outputs.py --out docs/benchmarks/structured-outputs

The default model (the Qwen2.5-0.5B shape, random weights) in bfloat16, 32-token prompts, 64 new tokens each
(ignore_eos; the constraints cannot complete in 64 tokens, so both batches run the same steps), B = 1 and 16. Two
constraints: a JSON schema (an object whose one field is a string of at least 2,000 characters) and a regex
(1,500 lower-case letters and spaces). Reports, per decode step (the engine's step() timed, prefill steps left
out; medians of each rep, then of the reps): the step, and the host work a constraint changes, timed by wrappers:
the engine filling the bitmask, the sampler (which applies it, on a copy of the logits), the engine taking the
tokens (which advances the matchers). The forward pass drifts by more than that work between runs on these VMs,
so the overhead is given both ways: the step against the plain one, and the host work's increase over the plain
run's as a share of the plain step. Writes OUT.json and OUT.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import machine_info
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.factory.checkpoint import ensure_default_model
from mini_infer.runner.sampler import Sampler

NEW_TOKENS, PROMPT_LEN, REPS = 64, 32, 3
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json={
        "type": "object", "required": ["text"], "additionalProperties": False,
        "properties": {"text": {"type": "string", "minLength": 2000}}}, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-z ]{1500}"),
}


class Timed:
    """Wall-clock seconds spent in the wrapped functions, since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, timed: Timed, tag: str):
    """(decode step seconds, timed host seconds per decode step, the outputs' token ids)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, work, tokens = [], [], {}
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.requests.values())
        timed.seconds = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding:
            steps.append(elapsed)
            work.append(timed.seconds)
        for output in outputs:
            tokens[output.request_id] = output.outputs[0].token_ids
    assert all(len(t) == NEW_TOKENS for t in tokens.values()), "every request runs all its steps"
    return steps, work, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.txt")
    parser.add_argument("--batch-sizes", default="1,16")
    args = parser.parse_args()
    info = machine_info()
    model = str(ensure_default_model())
    llm = LLM(model, dtype="bfloat16", max_num_seqs=16, max_model_len=PROMPT_LEN + NEW_TOKENS,
              enable_prefix_caching=False)
    engine = llm.engine
    timed = Timed()
    engine._grammar_bitmask = timed.wrap(engine._grammar_bitmask)
    engine._process = timed.wrap(engine._process)
    Sampler.__call__ = timed.wrap(Sampler.__call__)  # the runner calls its sampler instance
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = fixed_prompts(load_stream(model), max(batch_sizes), PROMPT_LEN)
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {"plain": plain, **{name: SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    structured_outputs=c) for name, c in CONSTRAINTS.items()}}
    for params in runs.values():  # warm up: kernels tuned, grammars compiled
        decode_steps(engine, prompts[:1], params, timed, "warm")
    rows = []
    for batch in batch_sizes:
        step_medians = {name: [] for name in runs}
        work_medians = {name: [] for name in runs}
        for rep in range(REPS):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for name in order:
                steps, work, _ = decode_steps(engine, prompts[:batch], runs[name], timed, f"{name}-{batch}-{rep}")
                step_medians[name].append(statistics.median(steps))
                work_medians[name].append(statistics.median(work))
        base = statistics.median(step_medians["plain"])
        base_host = statistics.median(work_medians["plain"])
        for name in runs:
            step, host = statistics.median(step_medians[name]), statistics.median(work_medians[name])
            rows.append({"batch": batch, "constraint": name, "step_ms_per_rep": [s * 1e3 for s in step_medians[name]],
                         "step_ms": step * 1e3, "step_vs_plain_pct": (step / base - 1) * 100,
                         "host_ms": host * 1e3, "host_extra_ms": (host - base_host) * 1e3,
                         "host_extra_pct_of_step": (host - base_host) / base * 100})
    flags = ", ".join(f for f, on in info["cpu_flags"].items() if on)
    lines = [f"{model} (bfloat16), {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens each (greedy, ignore_eos), "
             f"{REPS} reps interleaved; the median decode step of each rep, then the median of the reps",
             f"{info['cpu_model']} ({flags}), {info['torch_threads']} torch threads on {info['cpu_cores']} cores, "
             f"load average {info['load_average_1m']:.2f} at start", "",
             f"{'batch':>5}  {'constraint':<12} {'step ms':>8} {'per rep ms':>22} {'vs plain':>9} "
             f"{'host ms':>8} {'host extra ms':>14} {'of plain step':>14}"]
    for row in rows:
        reps = "/".join(f"{s:.1f}" for s in row["step_ms_per_rep"])
        lines.append(f"{row['batch']:>5}  {row['constraint']:<12} {row['step_ms']:>8.2f} {reps:>22} "
                     f"{row['step_vs_plain_pct']:>+8.1f}% {row['host_ms']:>8.3f} {row['host_extra_ms']:>14.3f} "
                     f"{row['host_extra_pct_of_step']:>13.2f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows, "new_tokens": NEW_TOKENS,
                                                    "prompt_len": PROMPT_LEN}, indent=2) + "\n")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
