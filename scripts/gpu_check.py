"""The prepared check of the GPU path on a lent CUDA machine: correctness on the device, then `mini-infer bench
--device cuda` and `mini-infer profile` for the Qwen2.5-0.5B and 7B shapes (random weights).

Usage, in the repository root:
  python scripts/gpu_check.py prepare
      on this (CPU) machine: copies the Qwen2.5 tokenizer into .device/tokenizer, which the device machine cannot
      build (it has no dashscope); name `.device` in the run's carry.
  python3 scripts/gpu_check.py run OUT STAGE[,STAGE...]
      on the device machine; stages, in this order:
        correct   the kernel, graph and GPU-path tests and the parity suite with MINI_INFER_TEST_DEVICE=cuda
        bench     0.5B shape, 32-token prompts, 128 new tokens, batch 1, 8, 32, 128, 256: mini-infer (graphs),
                  mini-infer-eager and HF generate on the same GPU, with the GPU's ceilings
        profile   one decode step at batch 1 and 256: before (torch ops, eager, synchronous), sync (Triton + graphs,
                  each step waiting for the one before) and after (Triton + graphs, async scheduling)
        nano      nano-vllm's workload on the 0.5B shape (mini-infer, and mini-infer-sync: without async scheduling)
        7b        the 7B shape: batch 1 beside HF generate, and nano-vllm's workload
Writes OUT/gpu_check.md (the summary, also printed last) and OUT/gpu_check.tar.gz (every table, JSON, chart, profile
and log). Each stage runs in a process of its own under a time limit; a failed stage is reported and the next runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / ".device" / "tokenizer"
MODELS = Path("/tmp/gpu-check-models")
STAGE_LIMIT_S = {"correct": 240, "bench": 300, "profile": 270, "nano": 300, "7b": 420}
STAGES = tuple(STAGE_LIMIT_S)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mini_infer.entrypoints.cli", *args]


def model(preset: str) -> Path:
    """The preset's random-weight bf16 checkpoint on local disk, written once (its tokenizer from .device)."""
    path = MODELS / preset
    if not (path / "config.json").is_file():
        subprocess.run(cli("make-model", "--preset", preset, "--out", str(path), "--tokenizer-from", str(TOKENIZER)),
                       cwd=ROOT, check=True)
    return path


def stage_commands(stage: str, work: Path) -> list[list[str]]:
    bench = ("bench", "--device", "cuda", "--dtype", "bfloat16")
    if stage == "correct":
        return [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_kernels.py",
                 "tests/test_graphs.py", "tests/test_gpu_path.py", "tests/test_parity.py"]]
    if stage == "bench":
        return [cli(*bench, "--model", str(model("qwen2.5-0.5b")), "--batch-sizes", "1,8,32,128,256", "--prompt-len",
                    "32", "--max-new-tokens", "128", "--reps", "3", "--out", str(work / "bench-0.5b"))]
    if stage == "profile":
        runs = []
        for batch in (1, 256):
            for name, flags in (("before", ("--gpu-kernels", "off", "--enforce-eager", "--no-async-scheduling")),
                                ("sync", ("--no-async-scheduling",)), ("after", ())):
                runs.append(cli("profile", "--device", "cuda", "--dtype", "bfloat16", "--model",
                                str(model("qwen2.5-0.5b")), "--batch-size", str(batch), "--steps", "20",
                                "--kv-cache-memory-gb", "8", *flags, "--out", str(work / f"profile-b{batch}-{name}")))
        return runs
    if stage == "nano":
        return [cli(*bench, "--workload", "nano-vllm", "--model", str(model("qwen2.5-0.5b")), "--systems",
                    "mini-infer,mini-infer-sync", "--reps", "1", "--out", str(work / "nano-0.5b"))]
    if stage == "7b":
        path = str(model("qwen2.5-7b"))
        return [cli(*bench, "--model", path, "--batch-sizes", "1", "--prompt-len", "32", "--max-new-tokens", "128",
                    "--systems", "hf-generate,mini-infer", "--reps", "3", "--out", str(work / "bench-7b")),
                cli(*bench, "--workload", "nano-vllm", "--model", path, "--systems", "mini-infer", "--reps", "1",
                    "--out", str(work / "nano-7b"))]
    raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")


def run_stage(stage: str, work: Path) -> dict:
    """Run the stage's commands in order under its time limit; its log goes to work/<stage>.log."""
    start, env = time.perf_counter(), dict(os.environ, MINI_INFER_TEST_DEVICE="cuda", PYTHONUNBUFFERED="1")
    log_path = work / f"{stage}.log"
    status = "ok"
    with log_path.open("w") as log:
        try:
            for command in stage_commands(stage, work):
                left = STAGE_LIMIT_S[stage] - (time.perf_counter() - start)
                log.write(f"$ {' '.join(command)}\n")
                log.flush()
                result = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=max(1.0, left))
                if result.returncode:
                    status = f"failed (exit {result.returncode})"
                    break
        except subprocess.TimeoutExpired:
            status = f"stopped at its {STAGE_LIMIT_S[stage]} s limit"
        except Exception as error:  # a model that could not be written, say: reported, and the next stage runs
            status = f"failed: {error!r}"
    tail = log_path.read_text().strip().splitlines()[-1:] if log_path.stat().st_size else [""]
    return {"stage": stage, "status": status, "seconds": time.perf_counter() - start, "last_line": tail[0]}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def summary(work: Path, stages: list[dict]) -> str:
    """The stages' outcomes, then the headline figures each produced."""
    import torch

    lines = [f"# GPU check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "", "| stage | status | s | last line |", "|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds']:.0f} | {s['last_line'][:100]} |" for s in stages]
    for name in ("bench-0.5b", "bench-7b"):
        report = _load(work / name / "fixed.json")
        if report is None:
            continue
        ceilings = report["ceilings"]
        lines += ["", f"## {name}: tok/s (median), % of the memory roofline, vs HF generate", "",
                  f"ceilings: {ceilings['compute_peak_gflops'] / 1e3:.0f} TFLOP/s {ceilings['compute_peak_source']}, "
                  f"{ceilings['read_gbs']:.0f} GB/s ({ceilings.get('memory_kind', 'read')})", "",
                  "| system | batch | tok/s | % roofline | vs HF |", "|---|---|---|---|---|"]
        for system, record in report["systems"].items():
            for r in record["results"]:
                ratio = r.get("speedup_vs_hf_generate")
                lines.append(f"| {system} | {r['batch_size']} | {r['tok_s']['median']:.0f} | "
                             f"{r['pct_of_roofline']:.1f}% | {f'{ratio:.2f}x' if ratio else '-'} |")
            if record["reason"]:
                lines.append(f"| {system} | skipped: {record['reason']} | | | |")
    for name in ("nano-0.5b", "nano-7b"):
        report = _load(work / name / "nano-vllm.json")
        for system, record in (report or {}).get("systems", {}).items():
            if record["summary"]:
                lines += ["", f"{name}: {system} {record['summary']['output_tok_s']['median']:.0f} output tok/s "
                              f"({report['requests']['output_tokens']} output tokens)"]
    profiles = sorted(work.glob("profile-*/profile.json"))
    if profiles:
        lines += ["", "## one decode step", "",
                  "| run | step ms | host work ms (schedule / input prep / update / outputs) | GPU kernels / step | "
                  "per layer | GPU busy ms |", "|---|---|---|---|---|---|"]
        for path in profiles:
            result = json.loads(path.read_text())
            gpu, host = result.get("gpu") or {}, result["host_ms"]
            parts = " / ".join(f"{host[part]:.3f}" for part in ("schedule", "input_prep", "update", "outputs"))
            lines.append(f"| {path.parent.name} | {result['unprofiled_step_ms']:.3f} | {host['total']:.3f} ({parts}) | "
                         f"{gpu.get('kernels_per_step', 0):.0f} | {gpu.get('kernels_per_layer', 0):.1f} | "
                         f"{gpu.get('kernel_ms_per_step', 0):.3f} |")
    return "\n".join(lines) + "\n"


def prepare() -> None:
    sys.path.insert(0, str(ROOT))
    from mini_infer.factory.tokenizer import write_tokenizer

    write_tokenizer(TOKENIZER)
    print(f"wrote {TOKENIZER}; carry .device in the device run")


def run(out: Path, stages: list[str]) -> None:
    if not TOKENIZER.is_dir():
        raise SystemExit(f"{TOKENIZER} is missing: run `python scripts/gpu_check.py prepare` here and carry .device")
    for stage in stages:
        if stage not in STAGES:
            raise SystemExit(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    work = out / "gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for stage in stages:
        results.append(run_stage(stage, work))
        print(f"[gpu_check] {stage}: {results[-1]['status']} in {results[-1]['seconds']:.0f} s", flush=True)
    text = summary(work, results)
    (work / "gpu_check.md").write_text(text)
    shutil.copy(work / "gpu_check.md", out / "gpu_check.md")
    with tarfile.open(out / "gpu_check.tar.gz", "w:gz") as archive:
        archive.add(work, arcname="gpu_check")
    shutil.rmtree(work)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare()
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 4:
        run(Path(sys.argv[2]), sys.argv[3].split(","))
    else:
        raise SystemExit(__doc__)
