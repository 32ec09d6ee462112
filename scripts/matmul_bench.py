"""Time the native matmul kernels on one decode step's weights of the Qwen2.5-0.5B shape (24 layers' distinct
QKV, O, gate/up, down weights plus the LM head, packed), called in a step's order so that the weights stream from
memory as in a real step. Prints ms, GFLOP/s and GB/s per matmul kind for each row count given.

    .venv/bin/python scripts/matmul_bench.py 1 8 16

With --quantization, the same step's weights quantised (the LM head in its method's head format, as the engine
does) run through each native quantised path given (--quant-paths, default: every one that runs here): a round
times one step of each and one of the bfloat16 kernel (--bf16-path), in an order shuffled every round (in a fixed
order, the step right after bf16's measured a few % apart from the same step later in the round). The machine's
memory speed drifts within seconds, so each round's ratio compares neighbours, and the median of the rounds' ratios
is printed.

    .venv/bin/python scripts/matmul_bench.py 1 --quantization int8,int4 --rounds 15
"""

import argparse
import random
import statistics
import time

import torch

from mini_infer.kernels import cpu, quant

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "head": (151936, 896)}
LAYERS = 24


def float_step(rows: list[int]) -> None:
    torch.manual_seed(0)
    weights = {name: [cpu.pack_weight(torch.randn(shape, dtype=torch.bfloat16) * 0.02)
                      for _ in range(1 if name == "head" else LAYERS)] for name, shape in SHAPES.items()}
    for m in rows:
        total_s = total_flop = 0.0
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for w in weights[name]:  # warm-up
                cpu.linear(x, w)
            reps = 3
            start = time.perf_counter()
            for _ in range(reps):
                for w in weights[name]:
                    cpu.linear(x, w)
            seconds = (time.perf_counter() - start) / reps
            flop, nbytes = 2 * m * n * k * len(weights[name]), 2 * n * k * len(weights[name])
            total_s, total_flop = total_s + seconds, total_flop + flop
            print(f"M={m:<3} {name:8s} {seconds * 1e3:7.2f} ms {flop / seconds / 1e9:6.1f} GFLOP/s "
                  f"{nbytes / seconds / 1e9:5.1f} GB/s")
        print(f"M={m:<3} all      {total_s * 1e3:7.2f} ms {total_flop / total_s / 1e9:6.1f} GFLOP/s")


def quantised_steps(rows: list[int], methods: list[str], paths: list[str], bf16_path: str, rounds: int) -> None:
    torch.manual_seed(0)
    dense = [(name, torch.randn(shape, dtype=torch.bfloat16) * 0.02)
             for name, shape in SHAPES.items() for _ in range(1 if name == "head" else LAYERS)]
    layout = cpu.weight_layout(bf16_path, torch.bfloat16)
    # label -> (its matmul, its path, the step's (shape name, packed weight))
    systems = {f"bf16 {bf16_path}": (cpu.linear, bf16_path,
                                     [(name, cpu.pack_weight(w, layout)) for name, w in dense])}
    for method in methods:
        packed = []
        for name, w in dense:
            head = quant.HEAD_METHOD[method] if name == "head" else method
            packed.append((name, quant.pack_panels(quant.quantize(w, head, torch.bfloat16))))
        for path in paths:
            systems[f"{method} {path}"] = (quant.quant_linear, path, packed)
    del dense

    def bytes_of(weight) -> int:
        return weight.data.numel() * weight.data.element_size()

    for m in rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (896, 4864)}

        def step(label: str) -> dict[str, float]:
            linear, path, weights = systems[label]
            seconds = dict.fromkeys(SHAPES, 0.0)
            for name, weight in weights:
                x = xs[weight.in_features]
                start = time.perf_counter()
                linear(x, weight, path=path)
                seconds[name] += time.perf_counter() - start
            return seconds

        for label in systems:  # warm-up
            step(label)
        times: dict[str, list[dict[str, float]]] = {label: [] for label in systems}
        order, shuffle = list(systems), random.Random(0).shuffle
        for _ in range(rounds):
            shuffle(order)
            for label in order:
                times[label].append(step(label))
        base = next(iter(systems))
        header = "".join(f"{name:>9s}" for name in SHAPES)
        print(f"M={m}, {rounds} rounds, ms per step (medians), GB/s of weights read, and the median of each round's "
              f"ratio to {base} (x)")
        print(f"{'system':24s}{header}     step    GB/s   ratio")
        for label, samples in times.items():
            per_shape = [statistics.median(s[name] for s in samples) for name in SHAPES]
            totals = [sum(s.values()) for s in samples]
            ratio = statistics.median(sum(b.values()) / t for b, t in zip(times[base], totals))
            nbytes = sum(bytes_of(w) for _, w in systems[label][2])
            step_s = statistics.median(totals)
            print(f"{label:24s}" + "".join(f"{v * 1e3:9.2f}" for v in per_shape)
                  + f" {step_s * 1e3:8.2f} {nbytes / step_s / 1e9:7.1f} {ratio:6.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, nargs="*", default=None, help="row counts (default 1 8 16; 1 with "
                                                                          "--quantization)")
    parser.add_argument("--quantization", default=None, help="comma list of int8, int4")
    parser.add_argument("--quant-paths", default=None, help="comma list of quant.QUANT_KERNELS paths (default: "
                                                            "every one that runs here)")
    parser.add_argument("--bf16-path", default=None, help="the bfloat16 kernel compared against (default: the last "
                                                          "native path that runs here, as cpu_kernels='on' picks)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.quantization is None:
        float_step(args.rows or [1, 8, 16])
        return
    paths = (args.quant_paths.split(",") if args.quant_paths
             else [path for path, why in quant.quant_paths().items() if why is None])
    float_paths = [path for path, why in cpu.matmul_paths(torch.bfloat16).items() if why is None]
    quantised_steps(args.rows or [1], args.quantization.split(","), paths, args.bf16_path or float_paths[-1],
                    args.rounds)


if __name__ == "__main__":
    main()
