"""`mini-infer bench-serve`: load-test a running OpenAI-compatible server over HTTP (vLLM's serving benchmark
figures): seeded random token-id prompts and output lengths, streamed /v1/completions requests sent by a fixed
number of concurrent clients or arriving as a Poisson process; per concurrency level it reports completed and
failed requests, request and token throughput, and TTFT / TPOT / ITL / E2E latency mean, p50, p90, p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mini_infer.bench.charts import scatter
from mini_infer.bench.options import at_least_one, int_list
from mini_infer.bench.report import Column, format_table, percentile, write_json

QWEN25_REGULAR_TOKENS = 151643  # ids below this are Qwen2.5's BPE tokens (the special tokens follow)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's only model)")
    parser.add_argument("--api-key", default=None, help="default: $MINI_INFER_API_KEY if set")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-concurrency", default="4",
                        help="clients with a request in flight, comma-separated for a sweep (e.g. 1,4,16)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: every client sends its next request at "
                             "once)")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="mean output tokens (EOS is ignored)")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths are uniform in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--vocab-size", type=int, default=QWEN25_REGULAR_TOKENS,
                        help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for serve.json and table.txt")
    return parser


@dataclass(frozen=True, slots=True)
class ServeOptions:
    base_url: str
    model: str | None
    api_key: str | None
    num_prompts: int
    concurrencies: tuple[int, ...]
    request_rate: float
    input_len: int
    output_len: int
    range_ratio: float
    vocab_size: int
    seed: int
    out: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        concurrencies = int_list("--max-concurrency", args.max_concurrency)
        for flag, value in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len),
                            ("--output-len", args.output_len), ("--vocab-size", args.vocab_size)):
            at_least_one(flag, value)
        if not 0 <= args.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
        if not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf for no pacing), got {args.request_rate}")
        api_key = args.api_key if args.api_key is not None else os.environ.get("MINI_INFER_API_KEY")
        return cls(args.base_url.rstrip("/"), args.model, api_key, args.num_prompts, concurrencies,
                   args.request_rate, args.input_len, args.output_len, args.range_ratio, args.vocab_size,
                   args.seed, args.out)


@dataclass(slots=True)
class RequestRecord:
    prompt_tokens: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first text
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    itl_ends: list[float] = field(default_factory=list)  # when each gap ended (time.perf_counter())


def sample_requests(options: ServeOptions, level: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, seeded by (--seed, level): each level sends prompts of its
    own, so a server's prefix cache cannot serve one level the prompts of another."""
    rng = random.Random(options.seed * 1_000_003 + level)

    def length(mean: int) -> int:
        low, high = max(1, int(mean * (1 - options.range_ratio))), max(1, int(mean * (1 + options.range_ratio)))
        return rng.randint(low, high)

    requests = []
    for _ in range(options.num_prompts):
        prompt_len, output_len = length(options.input_len), length(options.output_len)
        requests.append(([rng.randrange(options.vocab_size) for _ in range(prompt_len)], output_len))
    return requests


async def _one_request(client, url: str, headers: dict, model: str, prompt: list[int],
                       max_tokens: int) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error")
                    return record
                now = time.perf_counter()
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itls.append(now - last)
                        record.itl_ends.append(now)
                    last = now
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
            record.e2e = time.perf_counter() - start
            record.ok = record.ttft is not None
            if not record.ok:
                record.error = "the stream carried no text"
    except Exception as e:  # noqa: BLE001 - a failed request is a result to report, not a crash
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run_level(options: ServeOptions, model: str, requests, concurrency: int, log) -> dict:
    """All requests at one concurrency level; returns its metrics."""
    import httpx

    url = options.base_url + "/v1/completions"
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    rng = random.Random(options.seed + 1)
    gate = asyncio.Semaphore(concurrency)
    done = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:

        async def limited(prompt, max_tokens):
            nonlocal done
            async with gate:
                record = await _one_request(client, url, headers, model, prompt, max_tokens)
            done += 1
            if done % max(1, len(requests) // 8) == 0 or done == len(requests):
                log(f"concurrency {concurrency}: {done}/{len(requests)} requests done")
            return record

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if math.isfinite(options.request_rate):
                await asyncio.sleep(rng.expovariate(options.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return level_metrics(records, duration, concurrency, start)


def level_metrics(records: list[RequestRecord], duration: float, concurrency: int, start: float) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": concurrency, "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tok_s": output_tokens / duration,
        "total_tok_s": (output_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([gap for r in ok for gap in r.itls]), "e2e_ms": _stats([r.e2e for r in ok]),
        # every inter-token gap of the level: [seconds from the level's start to the gap's end, gap ms], in time order
        "itl_over_time": sorted([end - start, 1000 * gap] for r in ok for end, gap in zip(r.itl_ends, r.itls)),
    }


def _stats(seconds: list[float]) -> dict | None:
    if not seconds:
        return None
    ms = [1000 * s for s in seconds]
    return {"mean": statistics.fmean(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}


STAT = "{0[mean]:.0f}/{0[p50]:.0f}/{0[p90]:.0f}/{0[p99]:.0f}"
COLUMNS = (Column("clients", "max_concurrency"), Column("done", "completed"), Column("failed", "failed"),
           Column("req/s", "request_throughput", "{:.2f}"), Column("out tok/s", "output_tok_s", "{:.1f}"),
           Column("total tok/s", "total_tok_s", "{:.1f}"),
           *(Column(f"{metric.upper()} mean/p50/p90/p99 ms", f"{metric}_ms", STAT)
             for metric in ("ttft", "tpot", "itl", "e2e")))


def format_report(report: dict) -> str:
    config = report["config"]
    rate = "inf" if math.isinf(config["request_rate"]) else f"{config['request_rate']:g}/s"
    lines = [f"{config['base_url']} model {config['model']}: {config['num_prompts']} requests per level, prompts "
             f"~{config['input_len']} and outputs ~{config['output_len']} tokens (±{config['range_ratio']:.0%}, "
             f"seed {config['seed']}), request rate {rate}", "", format_table(COLUMNS, report["levels"])]
    lines += [f"concurrency {level['max_concurrency']} error: {error}" for level in report["levels"]
              for error in level["errors"]]
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace, log=None) -> dict:
    """Parse the flags, run every concurrency level one after another, print (and write) the report."""
    import httpx

    log = log or (lambda message: print(f"[bench-serve] {message}", flush=True))
    options = ServeOptions.from_args(args)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    try:
        models = httpx.get(options.base_url + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach a server at {options.base_url}: {e}") from None
    if models.status_code != 200:
        raise ValueError(f"{options.base_url}/v1/models answered {models.status_code}: {models.text[:200]}")
    model = options.model or models.json()["data"][0]["id"]
    levels = []
    for index, concurrency in enumerate(options.concurrencies):
        requests = sample_requests(options, index)
        log(f"concurrency {concurrency}: {len(requests)} requests")
        levels.append(asyncio.run(run_level(options, model, requests, concurrency, log)))
    config = {"base_url": options.base_url, "model": model, "num_prompts": options.num_prompts,
              "request_rate": options.request_rate, "input_len": options.input_len,
              "output_len": options.output_len, "range_ratio": options.range_ratio, "seed": options.seed,
              "prompts": "random token ids below --vocab-size; ignore_eos, temperature 0, streamed"}
    report = {"config": config, "levels": levels}
    table = format_report(report)
    print(table)
    if options.out is not None:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "serve.json", {**report, "config": {**config, "request_rate": str(options.request_rate)}})
        (out / "table.txt").write_text(table + "\n")
        scatter(out / "serve.png", f"inter-token gaps over the run: {options.base_url}, model {model}",
                [(f"{level['max_concurrency']} clients", *zip(*level["itl_over_time"]))
                 for level in levels if level["itl_over_time"]],
                "seconds since the level started", "gap between tokens of a stream (ms)")
        log(f"wrote {out / 'serve.json'}, {out / 'table.txt'} and {out / 'serve.png'}")
    return report
