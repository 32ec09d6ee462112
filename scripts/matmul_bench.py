"""Time the native matmul kernel on one decode step's weights of the Qwen2.5-0.5B shape (24 layers' distinct
QKV, O, gate/up, down weights plus the LM head, bfloat16, packed), so the weights stream from memory as in a
real step. Prints ms, GFLOP/s and GB/s per matmul kind for each row count given.

    .venv/bin/python scripts/matmul_bench.py 1 8 16
"""

import sys
import time

import torch

from mini_infer.kernels import cpu

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "head": (151936, 896)}
LAYERS = 24


def main(rows: list[int]) -> None:
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


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 16])
