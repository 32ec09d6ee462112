"""Which int4 rounding scheme to ship: each scheme's mean KL divergence from the bf16 model and the share of positions
whose top-1 token it keeps, over `bench --workload kl`'s text and positions (mini_infer/bench/kl.py), side by side.

Schemes (all groups of 32 inputs unless named; scales rounded to bf16 as the engine stores them; the LM head int8):
  q4_0         symmetric, llama.cpp's Q4_0 rule: scale = the group's largest |w| (signed) / -8 (what the engine runs)
  zero-point   asymmetric: scale = (max - min) / 15 and a zero point per group (the engine's int4 before)
  zero-point-fit  as zero-point, then per group the least-squares scale and zero for its integers, 3 rounds, over
               4 ranges shrunk about the middle (1, 0.95, 0.9, 0.85): the lowest squared error of the 4
  q4_0-fit     as q4_0, then the least-squares scale for its integers, 2 rounds, over scales of 1, 0.96, 0.92, 0.88
  q4_0-g16     as q4_0 in groups of 16 (5 bits a weight, as zero-point)

    .venv/bin/python scripts/int4_schemes_kl.py --out docs/benchmarks/int4-schemes-zen4

writes OUT.json and OUT.txt (the machine's CPU in both). Takes ~6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from mini_infer.bench.kl import text_logprobs
from mini_infer.factory.checkpoint import ensure_default_model
from mini_infer.kernels import quant

ENGINE_QUANTIZE = quant.quantize


def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.float().view(rows, cols // group, group)


def _tensor(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int) -> quant.QuantizedTensor:
    rows = q.shape[0]
    return quant.QuantizedTensor(q.to(torch.uint8).reshape(rows, -1), scales, zeros, 4, group, q.shape[1] * group,
                                 torch.bfloat16)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def zero_point_fit(weight: torch.Tensor, group: int = 32) -> quant.QuantizedTensor:
    w = _groups(weight, group)
    best = None
    for shrink in (1.0, 0.95, 0.9, 0.85):
        low, high = w.amin(-1), w.amax(-1)
        middle, half = (low + high) / 2, (high - low) / 2 * shrink
        scale = _bf16(2 * half / 15)
        zero = _bf16(middle - half + 8 * scale)
        for fit in range(4):
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = torch.round((w - zero[..., None]) / safe[..., None] + 8).clamp(0, 15)
            if fit == 3:
                break
            u = q - 8  # w ~ u * scale + zero, least squares per group
            su, suu, sw, suw = u.sum(-1), (u * u).sum(-1), w.sum(-1), (u * w).sum(-1)
            det = group * suu - su * su
            solvable = det > 0
            new_scale = torch.where(solvable, (group * suw - su * sw) / torch.where(solvable, det, 1.0), scale)
            zero = _bf16(torch.where(solvable, (sw - new_scale * su) / group, zero))
            scale = _bf16(new_scale)
        error = ((q - 8) * scale[..., None] + zero[..., None] - w).pow(2).sum(-1)
        if best is None:
            best = [error, scale, zero, q]
        else:
            better = error < best[0]
            best = [torch.where(better, error, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better, zero, best[2]), torch.where(better[..., None], q, best[3])]
    return _tensor(best[3], best[1], best[2], group)


def q4_0(weight: torch.Tensor, group: int = 32, fit: bool = False) -> quant.QuantizedTensor:
    w = _groups(weight, group)
    largest = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
    best = None
    for shrink in ((1.0, 0.96, 0.92, 0.88) if fit else (1.0,)):
        scale = _bf16(largest / -8 * shrink)
        for round_ in range(3 if fit else 1):
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = torch.floor(w / safe[..., None] + 8.5).clamp(0, 15)
            if round_ == 2 or not fit:
                break
            u = q - 8
            norm = (u * u).sum(-1)
            scale = _bf16(torch.where(norm > 0, (u * w).sum(-1) / torch.where(norm > 0, norm, 1.0), scale))
        error = ((q - 8) * scale[..., None] - w).pow(2).sum(-1)
        if best is None:
            best = [error, scale, q]
        else:
            better = error < best[0]
            best = [torch.where(better, error, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better[..., None], q, best[2])]
    return _tensor(best[2], best[1], None, group)


SCHEMES = {
    "q4_0": lambda w: q4_0(w),
    "zero-point": lambda w: ENGINE_QUANTIZE(w, quant.Scheme(4, 32, True, torch.bfloat16), torch.bfloat16),
    "zero-point-fit": zero_point_fit,
    "q4_0-fit": lambda w: q4_0(w, fit=True),
    "q4_0-g16": lambda w: q4_0(w, group=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a bf16 checkpoint (default: the benchmark model)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())

    def logprobs(**settings) -> torch.Tensor:  # held as float32 between schemes
        return text_logprobs(model, "bfloat16", **settings).float().double()

    base = logprobs()
    rows = {}
    for name, scheme in SCHEMES.items():
        def quantize(weight, method, scale_dtype, scheme=scheme):
            bits = method.bits if isinstance(method, quant.Scheme) else quant.method_scheme(method, scale_dtype).bits
            return scheme(weight) if bits == 4 else ENGINE_QUANTIZE(weight, method, scale_dtype)

        quant.quantize = quantize  # the engine quantises every int4 weight by this scheme
        try:
            ours = logprobs(quantization="int4")
        finally:
            quant.quantize = ENGINE_QUANTIZE
        kl = (base.exp() * (base - ours)).sum(-1)
        same = (base.argmax(-1) == ours.argmax(-1)).double().mean().item()
        rows[name] = {"mean_kl": kl.mean().item(), "top1_same_pct": 100 * same}
        print(f"{name}: mean KL {rows[name]['mean_kl']:.6f}, same top-1 {rows[name]['top1_same_pct']:.2f} %",
              flush=True)
    top = base.argmax(-1)
    counts = sorted(torch.bincount(top).tolist(), reverse=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    report = {"model": model, "positions": len(top), "distinct_top1_tokens": len([c for c in counts if c]),
              "largest_top1_token_counts": counts[:5], "cpu": cpu, "avx512_bf16": "avx512_bf16" in flags,
              "schemes": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"int4 schemes vs the bf16 model ({model}), {len(top)} positions of bench --workload kl; {cpu} "
             f"(avx512_bf16: {'yes' if report['avx512_bf16'] else 'no'}); the bf16 model's top-1 is one of "
             f"{report['distinct_top1_tokens']} tokens, the commonest at {counts[:5]} positions", "",
             f"{'scheme':<16} {'mean KL':>9} {'same top-1':>11}"]
    lines += [f"{name:<16} {row['mean_kl']:>9.6f} {row['top1_same_pct']:>10.2f}%" for name, row in rows.items()]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
