"""The `mini-infer` command: `make-model` writes a random-weight checkpoint, `generate` streams a completion,
`serve` runs the OpenAI-compatible server, `bench` compares mini-infer with HF transformers, `bench-serve`
load-tests a server, `profile` breaks a decode step down, `worker` runs one rank of a multi-node launch."""

from __future__ import annotations

import argparse
import sys
import time

_SAMPLING_FLAGS = {  # flag -> (type, SamplingParams field)
    "--temperature": (float, "temperature"),
    "--top-p": (float, "top_p"),
    "--top-k": (int, "top_k"),
    "--min-p": (float, "min_p"),
    "--repetition-penalty": (float, "repetition_penalty"),
    "--presence-penalty": (float, "presence_penalty"),
    "--frequency-penalty": (float, "frequency_penalty"),
    "--min-tokens": (int, "min_tokens"),
}


# The benchmark commands: their flags and code live in mini_infer.bench (the `bench` extra), imported only when one
# runs, so that `serve` and `generate` load nothing of the benchmarks.
BENCH_COMMANDS = {
    "bench": "output tokens/s of mini-infer and HF transformers on the same prompts, weights and threads; writes a "
             "table, JSON and a PNG chart",
    "profile": "break one decode step at batch B down by component",
    "bench-serve": "load-test a running server over HTTP: throughput and TTFT / TPOT / ITL / E2E latency percentiles",
}


def _build_parser() -> argparse.ArgumentParser:
    from mini_infer.engine.arg_utils import EngineArgs
    from mini_infer.entrypoints.openai.api_server import add_serve_args
    from mini_infer.factory import PRESETS

    parser = argparse.ArgumentParser(prog="mini-infer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-model", help="write a Qwen2.5-architecture checkpoint with random weights")
    make.add_argument("--preset", choices=sorted(PRESETS), required=True)
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    make.add_argument("--tokenizer-from", default=None,
                      help="copy tokenizer.json and tokenizer_config.json from this directory (default: build the "
                           "Qwen2.5 tokenizer from the dashscope package's vocabulary)")
    make.add_argument("--gguf", default=None, choices=["q4_k_m"],
                      help="write one GGUF file (--out FILE.gguf) with the weights quantised straight to this type, "
                           "as llama-quantize assigns its types (a model too large to write in bfloat16 first)")

    gen = commands.add_parser("generate", help="stream a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="also print the kernels the model runs and the autotuner's matmul choices")
    for flag, (kind, _) in _SAMPLING_FLAGS.items():
        gen.add_argument(flag, type=kind, default=None, help="default: the model's generation_config.json")
    EngineArgs.add_cli_args(gen)

    for name, text in BENCH_COMMANDS.items():  # listed here; `mini-infer NAME --help` is the bench's own parser's
        commands.add_parser(name, help=text)
    worker = commands.add_parser("worker", help="run one rank (RANK >= 1) of a torchrun-style multi-node launch; "
                                                "give it the engine flags rank 0 runs with")
    EngineArgs.add_cli_args(worker)
    add_serve_args(commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, "
                                                     "streaming, metrics)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in BENCH_COMMANDS:
        try:
            from mini_infer.bench import cli
        except ImportError as e:
            print(f"mini-infer: error: `mini-infer {argv[0]}` needs the bench extra (pip install "
                  f"'mini-infer[bench]'): {e}", file=sys.stderr)
            return 2
        return cli.main(argv)
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "make-model":
            return _make_model(args)
        if args.command == "worker":
            from mini_infer.engine.arg_utils import EngineArgs
            from mini_infer.executor.ranks import run_worker

            run_worker(EngineArgs.from_cli_args(args).create_engine_config())
            return 0
        if args.command == "serve":
            from mini_infer.entrypoints.openai.api_server import run_server

            return run_server(args)
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mini-infer: error: {e}", file=sys.stderr)
        return 2


def _make_model(args) -> int:
    from mini_infer.factory import make_model
    from mini_infer.factory.gguf_writer import make_gguf

    if args.gguf is not None:
        if args.tokenizer_from is not None:
            raise ValueError("--gguf writes the Qwen tokenizer's vocabulary; --tokenizer-from does not apply")
        path = make_gguf(args.preset, args.out, args.gguf, seed=args.seed)
    else:
        path = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, tokenizer_from=args.tokenizer_from)
    kind = args.gguf.upper() if args.gguf else args.dtype
    print(f"wrote the {args.preset} preset with random weights (seed {args.seed}, {kind}) to {path}")
    return 0


def _generate(args) -> int:
    from dataclasses import replace

    from mini_infer.engine.arg_utils import EngineArgs
    from mini_infer.sampling_params import RequestOutputKind

    engine = EngineArgs.from_cli_args(args).create_engine()
    chosen = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (_, field) in _SAMPLING_FLAGS.items()}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    params = replace(engine.default_sampling_params(), **chosen, max_tokens=args.max_tokens,
                     ignore_eos=args.ignore_eos, stop=args.stop, output_kind=RequestOutputKind.DELTA)
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError(f"--chat needs a tokenizer with a chat template; {engine.config.model} has none")
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine.add_request("cli", prompt, params)
    start = time.perf_counter()
    first_token_at, num_tokens, finish_reason = None, 0, None
    for output in engine.run_until_done():
        completion = output.outputs[0]
        sys.stdout.write(completion.text)
        sys.stdout.flush()
        num_tokens += len(completion.token_ids)
        first_token_at = first_token_at or time.perf_counter()
        finish_reason = completion.finish_reason
    end = time.perf_counter()
    decode_rate = (num_tokens - 1) / (end - first_token_at) if num_tokens > 1 else float("nan")
    print(f"\n[mini-infer] {num_tokens} tokens, finish_reason={finish_reason}; "
          f"first token {1000 * (first_token_at - start):.0f} ms, decode {decode_rate:.1f} tok/s "
          f"({engine.config.torch_dtype}, {engine.config.device})", file=sys.stderr)
    if args.verbose:
        from mini_infer.kernels.autotune import describe_choices

        stats = engine.memory_stats()[0]
        print(f"[mini-infer] kernels: {stats['kernels']}", file=sys.stderr)
        for line in describe_choices(stats["matmul_choices"] or {}):
            print(f"[mini-infer] matmul {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
