"""`bench --workload serving`: mini-infer's server and vLLM's CPU build's, each started on the same checkpoint and
driven in turn by vLLM's own load generator (`vllm bench serve`, from the vllm-cpu peer's environment), on two
workloads: short prompts (128 tokens in, 64 out, 64 requests at concurrency 16) and long ones (1024 in, 128 out, 32
requests at concurrency 8), random token ids, EOS ignored. Each server runs with its defaults; the report keeps
vLLM's result files whole."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.peer_env import PeerVenv
from mini_infer.bench.peers import VLLM_CPU, VLLM_KVCACHE_GB
from mini_infer.bench.report import Column, Workload
from mini_infer.bench.systems import SERVING_SYSTEMS
from mini_infer.config import SERVE_TARGET_ITL_MS

# name: (prompt tokens, output tokens, requests, concurrency)
SCENARIOS = {"short": (128, 64, 64, 16), "long": (1024, 128, 32, 8)}
STARTUP_TIMEOUT_S = 600
PERCENTILES = "50,99"


def run_serving(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    others = [s for s in options.systems if s not in SERVING_SYSTEMS]
    if others:
        raise ValueError(f"the serving workload runs servers of {', '.join(SERVING_SYSTEMS)}; not {', '.join(others)}")
    venv = PeerVenv("vllm-cpu")
    record = venv.ensure(VLLM_CPU, log)  # its `vllm bench serve` is the client for every server
    vllm = str(venv.venv / "bin" / "vllm")
    threads = torch.get_num_threads()
    vllm_env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GB),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(venv.root / "vllm-cache")}
    results, servers = {}, {}
    with tempfile.TemporaryDirectory(prefix="mini-infer-serving-") as scratch:
        for system in options.systems:
            port = _free_port()
            if system == "mini-infer":
                command = [sys.executable, "-c", "import sys; from mini_infer.entrypoints.cli import main; "
                           "sys.exit(main())", "serve", "--model", model_dir, "--dtype", options.dtype,
                           "--port", str(port), "--log-level", "warning"]
                env = {}
            else:
                command = [vllm, "serve", model_dir, "--dtype", options.dtype, "--port", str(port)]
                env = vllm_env
            servers[system] = {"command": ["mini-infer", *command[3:]] if system == "mini-infer" else command,
                               "env": env}
            log(f"{system}: starting its server")
            server_log = Path(scratch) / f"{system}.log"
            with open(server_log, "w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, **env}, start_new_session=True)
                try:
                    servers[system]["startup_s"] = _wait_ready(port, process, server_log)
                    for scenario, (input_len, output_len, num_prompts, concurrency) in SCENARIOS.items():
                        log(f"{system}: {scenario} prompts ({num_prompts} requests at concurrency {concurrency})")
                        name = f"{system}-{scenario}.json"
                        client = [vllm, "bench", "serve", "--backend", "openai", "--base-url",
                                  f"http://127.0.0.1:{port}", "--model", model_dir, "--tokenizer", model_dir,
                                  "--dataset-name", "random", "--random-input-len", str(input_len),
                                  "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
                                  "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(options.seed),
                                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
                                  "--save-result", "--save-detailed", "--result-dir", scratch,
                                  "--result-filename", name]
                        done = subprocess.run(client, env={**os.environ, **vllm_env}, capture_output=True, text=True)
                        if done.returncode:
                            raise RuntimeError(f"vllm bench serve against {system} failed: {done.stderr[-2000:]}")
                        results.setdefault(scenario, {})[system] = json.loads((Path(scratch) / name).read_text())
                finally:
                    os.killpg(process.pid, signal.SIGINT)
                    try:
                        process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
    return {"workload": "serving", "config": {
        "model": model_dir, "dtype": options.dtype, "scenarios": {name: dict(zip(
            ("input_len", "output_len", "num_prompts", "max_concurrency"), spec)) for name, spec in SCENARIOS.items()},
        "client": f"vllm bench serve ({record['package']}), --dataset-name random --ignore-eos --seed "
                  f"{options.seed}", "mini_infer_target_itl_ms": SERVE_TARGET_ITL_MS, "servers": servers},
        "results": results}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(port: int, process: subprocess.Popen, server_log: Path) -> float:
    """Seconds until the server lists its models; an error with its log's tail if it exits or never answers."""
    start = time.perf_counter()
    while time.perf_counter() - start < STARTUP_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {server_log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return time.perf_counter() - start
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer within {STARTUP_TIMEOUT_S} s: {server_log.read_text()[-2000:]}")


def _rows(report: dict) -> list[dict]:
    rows = []
    for scenario, by_system in report["results"].items():
        base = by_system.get("vllm-cpu")
        for system, r in by_system.items():
            rows.append({"scenario": scenario, "system": system, "completed": r["completed"],
                         "failed": r["failed"],
                         "out_tok_s": r["output_throughput"],
                         "vs_vllm": r["output_throughput"] / base["output_throughput"] if base else None,
                         **{key: r[key] for key in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                                                     "p99_itl_ms")}})
    return rows


def _headline(report: dict) -> list[str]:
    config = report["config"]
    scenarios = "; ".join(f"{name}: {s['num_prompts']} requests of {s['input_len']} prompt + {s['output_len']} new "
                          f"tokens at concurrency {s['max_concurrency']}" for name, s in config["scenarios"].items())
    return [f"{config['model']} ({config['dtype']}), each server with its defaults (mini-infer serve: "
            f"--target-itl-ms {config['mini_infer_target_itl_ms']:g}), client {config['client']}: {scenarios}"]


def _chart(report: dict) -> tuple[str, list[Panel]]:
    scenarios = list(report["results"])
    systems = list(dict.fromkeys(s for by_system in report["results"].values() for s in by_system))

    def series(key: str) -> list[Series]:
        return [Series(system, [report["results"][sc].get(system, {}).get(key, 0.0) for sc in scenarios])
                for system in systems]

    return (f"serving: {Path(report['config']['model']).name}, {report['config']['dtype']}, vllm bench serve",
            [Panel("output tok/s", scenarios, series("output_throughput")),
             Panel("median TTFT (ms)", scenarios, series("median_ttft_ms")),
             Panel("P99 inter-token latency (ms)", scenarios, series("p99_itl_ms"))])


SERVING = Workload(run_serving, _headline, (
    Column("workload", "scenario"), Column("server", "system"), Column("done", "completed"),
    Column("failed", "failed"), Column("out tok/s", "out_tok_s", "{:.1f}"), Column("vs vllm-cpu", "vs_vllm", "{:.2f}x"),
    Column("TTFT p50 ms", "median_ttft_ms", "{:.0f}"), Column("TPOT p50 ms", "median_tpot_ms", "{:.0f}"),
    Column("ITL p50 ms", "median_itl_ms", "{:.0f}"), Column("ITL p99 ms", "p99_itl_ms", "{:.0f}")),
    _rows, _chart)
