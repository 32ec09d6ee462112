"""Parallel sampling against separate requests: one request of n = 4 completions against 4 requests of the same
prompt (seeds 7..10, so the same 4 sequences), side by side in one process, reps interleaved.

    .venv/bin/python scripts/bench_parallel_sampling.py --prompt-len 512 --out docs/benchmarks/parallel-sampling-512
    .venv/bin/python scripts/bench_parallel_sampling.py --prompt-len 128 --out docs/benchmarks/parallel-sampling-128

The default model (the Qwen2.5-0.5B shape, random weights) in bfloat16, a prompt from the built-in texts, 64 new
tokens each, the model's sampling defaults (temperature 0.7, top_p 0.8, top_k 20, repetition penalty 1.1). Writes
OUT.json and OUT.txt with the machine's CPU. The n = 4 request prefills the prompt once (its later completions find
its blocks in the prefix cache); separate requests share it only where a later one is admitted after the first has
computed it (a prompt that fills a step's token budget), else each prefills it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from mini_infer import LLM
from mini_infer.bench.prompts import fixed_prompts, load_stream
from mini_infer.bench.report import machine_info
from mini_infer.factory.checkpoint import ensure_default_model

N, NEW_TOKENS, REPS = 4, 64, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.txt")
    args = parser.parse_args()
    prompt_len = args.prompt_len
    model = str(ensure_default_model())
    llm = LLM(model, dtype="bfloat16", max_num_seqs=8, max_model_len=prompt_len + NEW_TOKENS)
    # A prompt of its own for every timed run, so that none finds another's blocks cached; the last for the check.
    prompts = fixed_prompts(load_stream(model), 2 * REPS + 1, prompt_len)
    params = replace(llm.get_default_sampling_params(), max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
    cache = llm.engine.kv_cache

    def grouped(prompt):
        return [o.token_ids for o in llm.generate([prompt], replace(params, n=N), use_tqdm=False)[0].outputs]

    def separate(prompt):
        outs = llm.generate([prompt] * N, [replace(params, seed=7 + i) for i in range(N)], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert grouped(prompts[-1]) == separate(prompts[-1]), "the two ways must sample the same tokens"
    runs = {"n=4 (one request)": grouped, "4 separate requests": separate}
    times: dict[str, list[float]] = {name: [] for name in runs}
    computed: dict[str, list[int]] = {name: [] for name in runs}
    for rep in range(REPS):
        for i, (name, run) in enumerate(runs.items()):
            queries, hits = cache.prefix_queries, cache.prefix_hits
            start = time.perf_counter()
            run(prompts[2 * rep + i])
            times[name].append(time.perf_counter() - start)
            computed[name].append((cache.prefix_queries - queries) - (cache.prefix_hits - hits))
    info = machine_info()
    rows = {name: {"wall_s": times[name], "median_s": statistics.median(times[name]),
                   "output_tok_s": N * NEW_TOKENS / statistics.median(times[name]),
                   "prompt_tokens_computed": computed[name][-1]} for name in runs}
    base = rows["4 separate requests"]["median_s"]
    lines = [f"{model} (bfloat16), one {prompt_len}-token prompt, {N} completions of {NEW_TOKENS} tokens (seeds 7..10, "
             f"the model's sampling defaults), {REPS} reps interleaved, a prompt of its own each (none cached)",
             f"{info['cpu_model']} ({', '.join(f for f, on in info['cpu_flags'].items() if on)}), "
             f"{info['torch_threads']} torch threads on {info['cpu_cores']} cores", "",
             f"{'how':<22} {'median s':>9} {'min-max s':>13} {'out tok/s':>10} {'prompt tokens computed':>23} "
             f"{'speed-up':>9}"]
    for name, row in rows.items():
        lines.append(f"{name:<22} {row['median_s']:>9.2f} {min(row['wall_s']):>6.2f}-{max(row['wall_s']):<6.2f} "
                     f"{row['output_tok_s']:>10.1f} {row['prompt_tokens_computed']:>23} "
                     f"{base / row['median_s']:>8.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows, "n": N, "prompt_len": prompt_len,
                                                    "new_tokens": NEW_TOKENS}, indent=2) + "\n")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
