"""`mini-infer bench` flags, parsed and validated into BenchOptions (a ValueError names the bad flag), and the
parallel layouts (`--parallel tp2pp2`) they name."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path

from mini_infer.bench.peers import GGUF_OUTTYPES, PEER_NAMES
from mini_infer.config import QUANTIZATION_METHODS
from mini_infer.bench.systems import (CUDA_DEFAULT_SYSTEMS, CUDA_SYSTEMS, DEFAULT_SYSTEMS, GGUF_TYPE, QUANTIZED_SYSTEMS,
                                      SERVING_SYSTEMS)
from mini_infer.bench.systems import SYSTEM_NAMES as SYSTEMS

WORKLOADS = ("fixed", "prefill", "random", "nano-vllm", "parallel", "shared-prefix", "long-prompt", "kl",
             "structured-outputs", "parallel-sampling", "matmul", "serving", "speculative-draft",
             "speculative-ngram")
CUDA_WORKLOADS = ("fixed", "prefill", "random", "nano-vllm")
DEVICES = ("cpu", "cuda")
DTYPES = ("bfloat16", "float32")
SPECULATIVE_HALVES = ("draft", "ngram")
_SIZES = {"dp": "data_parallel_size", "tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed",
                        help="fixed: a sweep over batch sizes, every request the same length; prefill: one prompt "
                             "of --prompt-len tokens and one new token (time to first token, GFLOP/s against the "
                             "matmul peak); random: requests of random lengths, all submitted at once; "
                             "shared-prefix: prefix caching on vs off; long-prompt: chunked prefill on vs off "
                             "(README: Prefix caching and chunked prefill); kl: each quantised system's KL "
                             "divergence from its unquantised model over ~2,000 tokens of text (with --quantization); "
                             "nano-vllm: nano-vllm's benchmark (256 requests of random token ids, input and output "
                             "lengths uniform in [100, 1024], seed 0, temperature 0.6, EOS ignored); "
                             "structured-outputs: a constraint's cost per decode step at each batch size; "
                             "parallel-sampling: one request of n = 4 against 4 separate ones; matmul: one decode "
                             "step's matmuls on each native path (with --quantization, quantised against bfloat16; "
                             "--batch-sizes are its row counts, --reps its rounds); serving: mini-infer's and vLLM's "
                             "CPU servers under vLLM's load generator, short and long prompts (README: Serving); "
                             "speculative-draft, speculative-ngram: see --speculative")
    parser.add_argument("--model", default=None, help="local HF-format model directory (default: the random-weight "
                                                      "qwen2.5-0.5b preset), or a GGUF file, which mini-infer and "
                                                      "llama.cpp then both run as it is")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the systems run: cuda runs mini-infer (CUDA graphs for decode, async "
                             "scheduling), mini-infer-eager (--enforce-eager), mini-infer-sync "
                             "(--no-async-scheduling) and the HF baselines on the GPU, with the GPU's ceilings")
    parser.add_argument("--systems", default=None,
                        help=f"comma list of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)}; with --device "
                             f"cuda {','.join(CUDA_DEFAULT_SYSTEMS)}, of {', '.join(CUDA_SYSTEMS)}); the peers "
                             f"{' and '.join(PEER_NAMES)} are set up in their own environments under the mini-infer "
                             "cache on first use (minutes), or skipped with the reason")
    parser.add_argument("--gguf-outtype", choices=GGUF_OUTTYPES, default=None,
                        help="llama.cpp's weight type, converted once per checkpoint (default: --dtype's, bf16 or f32)")
    parser.add_argument("--kl-base", default=None,
                        help="kl workload: --model is a quantised GGUF file, which mini-infer and llama.cpp both run, "
                             "each against its own run of this unquantised model (a bf16 GGUF file, or a checkpoint "
                             "directory, which llama.cpp converts to bf16)")
    parser.add_argument("--quantization", default=None,
                        help="comma list of int8, int4: adds mini-infer with its weights quantised so (where "
                             "mini-infer runs) and llama.cpp's GGUF of the same bits, q8_0 or q4_0 (where llama.cpp "
                             "runs); or name mini-infer-int8, llama.cpp-q4_0 ... in --systems")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per setting (default 3, random 1)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="fixed workload: load each system alone, in turn, once per rep (the order reversed every "
                             "rep), for a model that two systems cannot hold in memory together")
    parser.add_argument("--out", default=None, help="results folder (default bench-results/<timestamp>)")
    fixed = parser.add_argument_group("fixed and prefill workloads")
    fixed.add_argument("--batch-sizes", default="1,8", help="comma list")
    fixed.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (prefill: try 512)")
    # 32 keeps the default run near 5 minutes on 2 cores, where HF's bf16 takes ~0.6 s a step at batch 8.
    fixed.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request")
    fixed.add_argument("--warmup-tokens", type=int, default=8, help="new tokens per request in the warm-up run")
    random = parser.add_argument_group("random workload")
    random.add_argument("--num-requests", type=int, default=64)
    random.add_argument("--input-len-range", default="16,256", help="LOW,HIGH prompt tokens (inclusive)")
    random.add_argument("--output-len-range", default="16,128", help="LOW,HIGH output tokens (inclusive)")
    random.add_argument("--batch-size", type=int, default=8, help="hf-generate's static batch size")
    random.add_argument("--seed", type=int, default=0)
    parallel = parser.add_argument_group("parallel workload (mini-infer only; README: Scale-out)")
    parallel.add_argument("--parallel", default=None,
                          help="comma list of layouts, e.g. single,dp2,tp2,pp2 (also tp2pp2): one batch decoded by "
                               "each; throughput and memory per rank (implies --workload parallel)")
    parallel.add_argument("--parallel-batch-size", type=int, default=8)
    parallel.add_argument("--parallel-new-tokens", type=int, default=128)
    speculative = parser.add_argument_group("speculative decoding (mini-infer only; bench/speculative.py)")
    speculative.add_argument("--speculative", choices=SPECULATIVE_HALVES, default=None,
                             help="draft: a draft model's cost, its proposals steered to a chosen acceptance alpha "
                                  "(random weights make real acceptance meaningless), with the cost model's "
                                  "prediction beside each speed-up; ngram: the n-gram proposer on output that copies "
                                  "its prompt with edits. Every setting against speculation off measured just "
                                  "before and after it (implies --workload speculative-draft or speculative-ngram)")
    speculative.add_argument("--target", default=None,
                             help="the target: a model directory or a factory preset (qwen2.5-0.5b, ...), written "
                                  "under the mini-infer cache on first use (default: --model's)")
    speculative.add_argument("--draft", default="qwen2.5-0.5b", help="the draft: a model directory or a preset")
    speculative.add_argument("--draft-quantization", choices=("int8", "int4"), default=None,
                             help="the draft's weights quantised at load (--quantization is the target's)")
    speculative.add_argument("--deterministic", choices=("on", "off"), default="on",
                             help="draft: every engine (speculation off too) in deterministic mode, where a verify "
                                  "row computes bit for bit what a decode step computes, so the target's greedy "
                                  "continuation stays known; off: the default arithmetic, whose bfloat16 near-ties "
                                  "a verify row can decide otherwise, after which a request has no known "
                                  "continuation (counted as diverged)")
    speculative.add_argument("--alphas", default="0,0.5,0.7,0.9,1",
                             help="comma list of the chance in [0, 1] that a draft position is the target's token "
                                  "(0 always runs: the cost model's costs are measured there)")
    speculative.add_argument("--ks", default="2,4,6", help="comma list of num_speculative_tokens, one engine each")
    speculative.add_argument("--batches", default="1,4,16", help="comma list of batch sizes")
    speculative.add_argument("--max-tokens", type=int, default=64,
                             help="new tokens per request (draft; ngram's outputs are the passages' length)")
    speculative.add_argument("--adaptive-alphas", default="0",
                             help="comma list of the alphas also run with adaptive k (an engine per k), or 'none'")
    speculative.add_argument("--prompt-lookup", default="2,4", help="ngram: MIN,MAX tokens of the suffix looked up")
    speculative.add_argument("--edit-every", type=int, default=8, help="ngram: a word in this many is changed")
    speculative.add_argument("--note", default=None,
                             help="a line for the table's headline: what else ran on the machine, say")


@dataclass(frozen=True, slots=True)
class BenchOptions:
    workload: str
    device: str
    model: str | None
    dtype: str
    systems: tuple[str, ...]
    gguf_outtype: str | None
    kl_base: str | None
    reps: int
    one_at_a_time: bool
    out: Path
    quantization: tuple[str, ...]  # --quantization's methods
    batch_sizes: tuple[int, ...]
    prompt_len: int
    max_new_tokens: int
    warmup_tokens: int
    num_requests: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    batch_size: int
    seed: int
    parallel: tuple[str, ...]
    parallel_batch_size: int
    parallel_new_tokens: int
    speculative: str | None
    target: str | None
    draft: str
    draft_quantization: str | None
    deterministic: str
    alphas: tuple[float, ...]
    ks: tuple[int, ...]
    batches: tuple[int, ...]
    max_tokens: int
    adaptive_alphas: tuple[float, ...]
    prompt_lookup: tuple[int, int]
    edit_every: int
    note: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        cuda = args.device == "cuda"
        defaults = CUDA_DEFAULT_SYSTEMS if cuda else SERVING_SYSTEMS if args.workload == "serving" else DEFAULT_SYSTEMS
        named = args.systems if args.systems is not None else ",".join(defaults)
        systems = [s.strip() for s in named.split(",") if s.strip()]
        if not systems or any(s not in SYSTEMS for s in systems) or len(set(systems)) != len(systems):
            raise ValueError(f"--systems must be a comma list of distinct names from {', '.join(SYSTEMS)}, "
                             f"got {named!r}")
        _check_device(args, systems)
        methods = []
        if args.quantization is not None:
            methods = [m.strip() for m in args.quantization.split(",") if m.strip()]
            if not methods or any(m not in QUANTIZATION_METHODS for m in methods):
                raise ValueError(f"--quantization must be a comma list of {', '.join(QUANTIZATION_METHODS)}, got "
                                 f"{args.quantization!r}")
            for method in methods:
                systems += [name for name, (base, kind) in QUANTIZED_SYSTEMS.items()
                            if base in systems and kind in (method, GGUF_TYPE[method]) and name not in systems]
        workload = "parallel" if args.parallel is not None else args.workload
        if args.speculative is not None:
            workload = f"speculative-{args.speculative}"
        if workload.startswith("speculative") and len(methods) > 1:
            raise ValueError(f"--quantization: the speculative workloads quantise the target one way, got {methods}")
        if args.one_at_a_time and workload != "fixed":
            raise ValueError(f"--one-at-a-time is the fixed workload's, not {workload}'s")
        if args.kl_base is not None and workload != "kl":
            raise ValueError(f"--kl-base is the kl workload's, not {workload}'s")
        reps = args.reps if args.reps is not None else (1 if workload == "random" else 3)
        for flag in ("--reps", "--parallel-batch-size", "--parallel-new-tokens", "--prompt-len", "--max-new-tokens",
                     "--warmup-tokens", "--num-requests", "--batch-size", "--max-tokens", "--edit-every"):
            at_least_one(flag, reps if flag == "--reps" else getattr(args, flag[2:].replace("-", "_")))
        out = Path(args.out) if args.out else Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
        given = {f.name: getattr(args, f.name) for f in fields(cls)}  # the flags kept as parsed
        return cls(**{**given, "workload": workload, "reps": reps, "out": out, "quantization": tuple(methods),
                      "systems": tuple(s for s in SYSTEMS if s in systems),
                      "batch_sizes": tuple(sorted(set(int_list("--batch-sizes", args.batch_sizes)))),
                      "input_len_range": _range("--input-len-range", args.input_len_range),
                      "output_len_range": _range("--output-len-range", args.output_len_range),
                      "parallel": _layouts(args.parallel if args.parallel is not None else "single,dp2,tp2,pp2"),
                      "alphas": _alphas("--alphas", args.alphas),
                      "adaptive_alphas": () if args.adaptive_alphas.strip() == "none"
                      else _alphas("--adaptive-alphas", args.adaptive_alphas),
                      "ks": tuple(sorted(set(int_list("--ks", args.ks)))),
                      "batches": tuple(sorted(set(int_list("--batches", args.batches)))),
                      "prompt_lookup": _range("--prompt-lookup", args.prompt_lookup)})


def _check_device(args: argparse.Namespace, systems: list[str]) -> None:
    """--device cuda runs the systems that run on a GPU, the workloads that measure one, on a machine that has one;
    mini-infer-eager (no graphs) and mini-infer-sync (no async scheduling) exist on a GPU only."""
    if args.device == "cpu":
        for name, without in (("mini-infer-eager", "CUDA graphs"), ("mini-infer-sync", "async scheduling")):
            if name in systems:
                raise ValueError(f"--systems {name} (mini-infer without {without}) runs with --device cuda")
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine")
    others = [s for s in systems if s not in CUDA_SYSTEMS]
    if others or args.quantization is not None:
        raise ValueError(f"--device cuda runs {', '.join(CUDA_SYSTEMS)}; not {', '.join(others) or 'quantised systems'}"
                         " (the peers and quantised weights run on the CPU)")
    workload = "parallel" if args.parallel is not None else args.workload
    if workload not in CUDA_WORKLOADS:
        raise ValueError(f"--device cuda runs the workloads {', '.join(CUDA_WORKLOADS)}, not {workload!r}")


def parse_layout(name: str) -> dict[str, int]:
    """`single`, or sizes such as dp2, tp2, pp2, tp2pp2, as the EngineConfig parallel sizes that differ from 1."""
    if name == "single":
        return {}
    if not re.fullmatch(r"(?:(?:dp|tp|pp)[1-9]\d*)+", name):
        raise ValueError(f"--parallel takes 'single' or sizes like dp2, tp2, pp2, tp2pp2; got {name!r}")
    sizes = {}
    for kind, size in re.findall(r"(dp|tp|pp)(\d+)", name):
        if _SIZES[kind] in sizes:
            raise ValueError(f"--parallel: {name!r} gives {kind} twice")
        sizes[_SIZES[kind]] = int(size)
    return sizes


def _layouts(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--parallel must be a comma list of distinct layouts, got {text!r}")
    for name in names:
        parse_layout(name)
    return names


def at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} must be a comma list of integers >= 1, got {text!r}")
    return values


def _alphas(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(sorted({float(part) for part in text.split(",")}))
    except ValueError:
        values = ()
    if not values or any(not 0 <= v <= 1 for v in values):
        raise ValueError(f"{flag} must be a comma list of numbers in [0, 1], got {text!r}")
    return values


def _range(flag: str, text: str) -> tuple[int, int]:
    values = int_list(flag, text)
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"{flag} must be LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return values
