"""The benchmark commands of `mini-infer` (bench, profile, bench-serve): their flags and what runs them. Only these
commands import the benchmarks, whose own dependencies (matplotlib for the charts) are the `bench` extra."""

from __future__ import annotations

import argparse
import sys

from mini_infer.bench.options import BenchOptions, add_bench_args
from mini_infer.bench.profile import add_profile_args, run_profile
from mini_infer.bench.serve import add_bench_serve_args, run_bench_serve


def build_parser() -> argparse.ArgumentParser:
    """The parser of the benchmark commands, whose argv starts with the command (entrypoints.cli.BENCH_COMMANDS)."""
    parser = argparse.ArgumentParser(prog="mini-infer")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_args(commands.add_parser("bench"))
    add_profile_args(commands.add_parser("profile"))
    add_bench_serve_args(commands.add_parser("bench-serve"))
    return parser


def main(argv: list[str]) -> int:
    """Run `mini-infer COMMAND ...` for a benchmark command."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            from mini_infer.bench.run import run_bench
            from mini_infer.engine.arg_utils import EngineArgs

            from mini_infer import gguf_file

            options = BenchOptions.from_args(args)
            model = EngineArgs(model=options.model).resolved_model()
            if gguf_file.is_gguf(model):  # its directory: mini-infer and llama.cpp both run the file itself
                model = str(gguf_file.model_dir(model))
            run_bench(options, model)
            return 0
        if args.command == "profile":
            return run_profile(args)
        run_bench_serve(args)
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"mini-infer: error: {e}", file=sys.stderr)
        return 2
