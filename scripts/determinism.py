"""Same seed, same answer: greedy and seeded outputs (tokens and logprobs) of one workload on a roomy KV cache, on a
tight one (preemption by recompute, small prompt chunks) and request by request alone, with and without
`deterministic`; then deterministic mode's cost at batch 1 and 8 on the default model.

    python scripts/determinism.py [--prompts 300] [--out docs/benchmarks/determinism-<cpu>]

Writes results.json and results.md to --out. Random weights are fine here: the measure is whether two runs of the
same request agree, not what they say.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from mini_infer import LLM, SamplingParams
from mini_infer import machine
from mini_infer.factory import ensure_default_model, make_model

# The workloads: float32 on a 20 x 4-block cache; bfloat16 on a 24 x 4-block cache with a 24-token budget.
TIGHT = {"float32": dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=32),
         "bfloat16": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=24)}
ROOMY = dict(num_kv_blocks=4096, block_size=4, max_num_batched_tokens=512)


Workload = tuple[list[dict], list[SamplingParams], list[str]]


def workload(count: int, seed: int = 0) -> Workload:
    """`count` prompts of 4-24 random tokens (16-48 new ones): a third greedy, a third seeded (temperature 0.9,
    top_p 0.9), a third unseeded; every one asks for its two top logprobs."""
    rng = random.Random(seed)
    prompts, params, kinds = [], [], []
    for i in range(count):
        prompts.append({"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(rng.randint(4, 24))]})
        kind = ("greedy", "seeded", "unseeded")[i % 3]
        max_tokens = rng.randint(16, 48)
        common = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        params.append(SamplingParams(temperature=0.0, **common) if kind == "greedy" else
                      SamplingParams(temperature=0.9, top_p=0.9, seed=i if kind == "seeded" else None, **common))
        kinds.append(kind)
    return prompts, params, kinds


def answers(outputs) -> list[tuple]:
    """Each request's tokens and, per token, its logprob and top-2 (bit for bit: floats as they are)."""
    result = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in completion.logprobs)
        result.append((tuple(completion.token_ids), logprobs))
    return result


def run(model: str, dtype: str, deterministic: bool, prompts, params, cache: dict) -> tuple[list[tuple], int, float]:
    """(answers, preemptions, seconds) of the whole workload at once on an engine with `cache`."""
    llm = LLM(model, dtype=dtype, max_model_len=128, deterministic=deterministic, **cache)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return answers(outputs), llm.engine.stats().num_preemptions, seconds


def alone(model: str, dtype: str, deterministic: bool, prompts, params) -> list[tuple]:
    """Each request on its own (one engine, one request at a time)."""
    llm = LLM(model, dtype=dtype, max_model_len=128, deterministic=deterministic, **ROOMY)
    return [answers(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(prompts, params)]


def mismatches(a: list[tuple], b: list[tuple], kinds: list[str]) -> dict:
    """Per kind compared (greedy, seeded): requests whose tokens differ, and whose tokens agree but logprobs not."""
    found = {}
    for kind in ("greedy", "seeded"):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        found[kind] = {"tokens": sum(a[i][0] != b[i][0] for i in rows),
                       "logprobs": sum(a[i][0] == b[i][0] and a[i][1] != b[i][1] for i in rows), "of": len(rows)}
    return found


def consistency(model: str, dtype: str, count: int) -> list[dict]:
    prompts, params, kinds = workload(count)
    rows = []
    for deterministic in (False, True):
        roomy, _, _ = run(model, dtype, deterministic, prompts, params, ROOMY)
        tight, preemptions, _ = run(model, dtype, deterministic, prompts, params, TIGHT[dtype])
        single = alone(model, dtype, deterministic, prompts, params)
        rows.append({"dtype": dtype, "deterministic": deterministic, "prompts": count, "tight_cache": TIGHT[dtype],
                     "preemptions": preemptions, "tight_vs_roomy": mismatches(tight, roomy, kinds),
                     "roomy_vs_alone": mismatches(roomy, single, kinds),
                     "tight_vs_alone": mismatches(tight, single, kinds)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def cost(model: str, dtype: str, batch: int, rounds: int = 3) -> dict:
    """Decode tokens/s at `batch` (seeded sampling, 64 tokens after a 32-token prompt) and prefill tokens/s of one
    512-token prompt, normal against deterministic, interleaved round by round (the median of each)."""
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(32)]} for _ in range(batch)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=64, ignore_eos=True) for i in range(batch)]
    long = {"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(512)]}
    engines = {mode: LLM(model, dtype=dtype, deterministic=mode, max_model_len=1024, enable_prefix_caching=False)
               for mode in (False, True)}
    decode, prefill = {False: [], True: []}, {False: [], True: []}
    for llm in engines.values():  # warm-up: the autotuner's timing, first-touch pages
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(long, SamplingParams(max_tokens=1), use_tqdm=False)
    for _ in range(rounds):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            decode[mode].append(batch * 64 / (time.perf_counter() - start))
            start = time.perf_counter()
            llm.generate(long, SamplingParams(max_tokens=1), use_tqdm=False)
            prefill[mode].append(512 / (time.perf_counter() - start))
    med = {name: {mode: sorted(v)[len(v) // 2] for mode, v in series.items()}
           for name, series in (("decode", decode), ("prefill", prefill))}
    return {"dtype": dtype, "batch": batch,
            **{f"{name}_tok_s": {"normal": m[False], "deterministic": m[True], "slowdown": m[False] / m[True]}
               for name, m in med.items()}}


def markdown(rows: list[dict], costs: list[dict], label: str, command: str) -> str:
    lines = [f"# Same seed, same answer ({label})", "", f"`{command}`", "",
             "Requests whose tokens differ (and, in brackets, whose tokens agree but logprobs differ), of the greedy "
             "and the seeded thirds; unseeded requests are not compared.", "",
             "| dtype | deterministic | prompts | preemptions (tight) | greedy tight vs roomy | seeded tight vs roomy "
             "| greedy roomy vs alone | seeded roomy vs alone | greedy tight vs alone | seeded tight vs alone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[c][k]['tokens']} ({r[c][k]['logprobs']}) of {r[c][k]['of']}"
                 for c in ("tight_vs_roomy", "roomy_vs_alone", "tight_vs_alone") for k in ("greedy", "seeded")]
        lines.append(f"| {r['dtype']} | {r['deterministic']} | {r['prompts']} | {r['preemptions']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Deterministic mode's cost on the default model (qwen2.5-0.5b, random weights): decode tok/s "
              "(seeded sampling, 64 tokens) and prefill tok/s (one 512-token prompt), medians of interleaved rounds.",
              "", "| dtype | batch | decode normal | decode deterministic | slowdown | prefill normal | "
              "prefill deterministic | slowdown |", "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        d, p = c["decode_tok_s"], c["prefill_tok_s"]
        lines.append(f"| {c['dtype']} | {c['batch']} | {d['normal']:.1f} | {d['deterministic']:.1f} | "
                     f"{d['slowdown']:.2f}x | {p['normal']:.0f} | {p['deterministic']:.0f} | {p['slowdown']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cost-batches", default="1,8", help="batch sizes to time ('' to skip)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    label = f"{machine.cpu().model} [{', '.join(machine.cpu().isa)}], {torch.get_num_threads()} threads"
    out = args.out or Path("docs/benchmarks") / "determinism"
    rows, costs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            tiny = make_model("tiny", Path(tmp) / dtype, seed=0, dtype=dtype)
            rows += consistency(str(tiny), dtype, args.prompts)
    default = str(ensure_default_model())
    for dtype in args.dtypes.split(","):
        for batch in [int(b) for b in args.cost_batches.split(",") if b]:
            costs.append(cost(default, dtype, batch))
            print(json.dumps(costs[-1]), file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/determinism.py " + " ".join(sys.argv[1:])
    (out / "results.json").write_text(json.dumps({"cpu": label, "torch": torch.__version__, "command": command,
                                                  "consistency": rows, "cost": costs}, indent=1))
    (out / "results.md").write_text(markdown(rows, costs, label, command.strip()))
    print(markdown(rows, costs, label, command.strip()))


if __name__ == "__main__":
    main()
