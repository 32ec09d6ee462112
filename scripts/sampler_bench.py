"""Time the sampler alone at batch B over the real vocabulary (151,936) for several parameter sets, random
logits, every row with a 160-token context for its penalties. Compares sampler implementations side by side:

    python scripts/sampler_bench.py [--batch 32] [--reps 20] [--dtype float32|bfloat16] [--native] [SAMPLER_FILE ...]

Each SAMPLER_FILE is a copy of mini_infer/runner/sampler.py (e.g. from `git show REV:mini_infer/runner/sampler.py`;
default: this checkout's). With --native each gets what the runner hands it when the native CPU kernels run: their
argmax, and their top-k where that sampler takes one.
"""

import argparse
import importlib.util
import inspect
import statistics
import sys
import time

import torch

from mini_infer.model.ops import select_ops
from mini_infer.runner.plan import NewRequest
from mini_infer.sampling_params import SamplingParams

VOCAB = 151_936
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 1 + top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "model defaults (t 0.7, top_p 0.8, top_k 20, rep 1.1)": SamplingParams(temperature=0.7, top_p=0.8, top_k=20,
                                                                           repetition_penalty=1.1),
}


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"sampler_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.Sampler


def time_case(sampler_class, params: SamplingParams, batch: int, reps: int, dtype: torch.dtype,
              native: bool) -> float:
    kwargs = {}
    if native:
        ops = select_ops("on", dtype, "cpu")
        kwargs["argmax"] = ops.argmax
        if "top_k" in inspect.signature(sampler_class).parameters:
            kwargs["top_k"] = ops.top_k
    sampler = sampler_class(VOCAB, torch.device("cpu"), 0, **kwargs)
    gen = torch.Generator().manual_seed(0)
    for slot in range(batch):
        tokens = torch.randint(0, VOCAB, (160,), generator=gen).tolist()
        sampler.add(NewRequest(str(slot), slot, tokens, 128, 0, [], params, ()))
    logits = (torch.randn(batch, VOCAB, generator=gen) * 3).to(dtype)
    slots = list(range(batch))
    sampler(logits, slots)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sampler(logits, slots)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the logits' dtype")
    parser.add_argument("--native", action="store_true", help="the native kernels' argmax and top-k, as the runner's")
    parser.add_argument("samplers", nargs="*", default=["mini_infer/runner/sampler.py"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    classes = {path: load(path) for path in args.samplers}
    print(f"sampler ms per call (median of {args.reps}), batch {args.batch}, vocabulary {VOCAB}, {args.dtype} logits, "
          f"{'native kernels' if args.native else 'torch ops'}, {torch.get_num_threads()} threads")
    print("| parameters | " + " | ".join(args.samplers) + " |")
    print("|---|" + "---|" * len(args.samplers))
    for name, params in CASES.items():
        cells = [f"{time_case(cls, params, args.batch, args.reps, dtype, args.native):.1f}" for cls in classes.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
