"""Whether int8 weights could take int8 activations: each variant's mean KL divergence from the bf16 model and the share
of positions whose top-1 token it keeps, over `bench --workload kl`'s text and positions (mini_infer/bench/kl.py).

With activations in int8 (as llama.cpp's Q8_0 dot products quantise them, per block of 32 with one scale each) the
AVX512_VNNI / AVX-VNNI `vpdpbusd` would multiply 64 bytes of weights per instruction, against two `vpdpwssd` for
the int16 activations the engine rounds to. Variants (weights: the engine's int8, groups of 32, bf16 scales):
  int16 x           what the engine runs: x rounded to int16 per group of 32 (a power-of-two scale)
  int8 x            x rounded to int8 per group of 32, scale = the group's largest |x| / 127 in float32
  int8 x, fp16 d    as int8 x, each scale rounded to float16 (Q8_0's activation blocks)
  int8 x, fp16 w    as int8 x, the weights' scales in float16 instead of bf16 (Q8_0's weight blocks)
The int8 x variants hand the matmul x already rounded (in float32; the kernel's int16 rounding of it adds at most
2^-16 of a group's largest value).

    .venv/bin/python scripts/int8_activations_kl.py --out docs/benchmarks/int8-activations-zen4

writes OUT.json (with bench.report.machine_info) and OUT.txt (the CPU named). Takes ~5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from mini_infer.bench.kl import divergence, text_logprobs
from mini_infer.bench.report import machine_info
from mini_infer.factory.checkpoint import ensure_default_model
from mini_infer.kernels import quant

ENGINE_LINEAR, ENGINE_SCALE_DTYPE = quant.quant_linear, quant.scale_dtype
GROUP = 32


def int8_rows(x: torch.Tensor, fp16_scales: bool) -> torch.Tensor:
    """x [M, K] rounded to int8 per group of GROUP (scale = the group's largest |x| / 127), as float32."""
    rows, cols = x.shape
    padded = -(-cols // GROUP) * GROUP
    groups = F.pad(x.float(), (0, padded - cols)).view(rows, padded // GROUP, GROUP)
    scales = groups.abs().amax(dim=-1, keepdim=True) / 127
    if fp16_scales:
        scales = scales.half().float()
    q = torch.round(groups / torch.where(scales == 0, torch.ones_like(scales), scales)).clamp_(-127, 127)
    return (q * scales).view(rows, padded)[:, :cols].contiguous()


def int8_activations(fp16_scales: bool):
    def linear(x, weight, bias=None, path="avx2"):
        out = ENGINE_LINEAR(int8_rows(x, fp16_scales), weight, None if bias is None else bias.float(), path)
        return out.to(x.dtype)
    return linear


VARIANTS = {  # name: (quant_linear, the dtype a bf16 model's scales are rounded to)
    "int16 x": (ENGINE_LINEAR, torch.bfloat16),
    "int8 x": (int8_activations(False), torch.bfloat16),
    "int8 x, fp16 d": (int8_activations(True), torch.bfloat16),
    "int8 x, fp16 w": (int8_activations(False), torch.float16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a bf16 checkpoint (default: the benchmark model)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    base = text_logprobs(model, "bfloat16")
    rows = {}
    for name, (linear, scales) in VARIANTS.items():
        quant.quant_linear = linear  # the engine's int8 matmuls and its quantisation of a bf16 model's scales
        quant.scale_dtype = lambda dtype, s=scales: s if dtype == torch.bfloat16 else ENGINE_SCALE_DTYPE(dtype)
        try:
            kl, same = divergence(base, text_logprobs(model, "bfloat16", quantization="int8"))
        finally:
            quant.quant_linear, quant.scale_dtype = ENGINE_LINEAR, ENGINE_SCALE_DTYPE
        rows[name] = {"mean_kl": kl.mean().item(), "top1_same_pct": 100 * same.double().mean().item()}
        print(f"{name}: mean KL {rows[name]['mean_kl']:.6f}, same top-1 {rows[name]['top1_same_pct']:.2f} %",
              flush=True)
    machine = machine_info()
    cpu = f"{machine['cpu_model']} (avx512_bf16: {'yes' if machine['cpu_flags']['avx512_bf16'] else 'no'})"
    report = {"model": model, "positions": len(base), "machine": machine, "variants": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"int8 weights with int16 or int8 activations vs the bf16 model ({model}), {len(base)} positions of "
             f"bench --workload kl; {cpu}", "", f"{'variant':<16} {'mean KL':>9} {'same top-1':>11}"]
    lines += [f"{name:<16} {row['mean_kl']:>9.6f} {row['top1_same_pct']:>10.2f}%" for name, row in rows.items()]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
