"""The workloads that measure a scheduler feature against the same engine without it (mini-infer only, each
setting on a fresh engine after a warm-up on unrelated prompts): shared-prefix (32 requests sharing a 512-token
system prompt: TTFT and throughput, prefix caching off vs on) and long-prompt (8 decoding streams while long
prompts arrive: the streams' inter-token latency, chunked prefill off vs on)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import load_stream
from mini_infer.bench.report import Column, Workload, percentile
from mini_infer.bench.systems import MiniInferSystem, greedy
from mini_infer.config import SERVE_TARGET_ITL_MS
from mini_infer.sampling_params import RequestOutputKind

SYSTEM_LEN, QUESTION_LEN, NUM_QUESTIONS, ANSWER_LEN = 512, 32, 32, 32
NUM_STREAMS, STREAM_PROMPT_LEN, STREAM_LEN = 8, 32, 128
LONG_PROMPT_LENS, LONG_EVERY_STEPS = (1024, 2048, 1536, 1024), 16
DELTA = RequestOutputKind.DELTA


def _warm_engine(model_dir: str, dtype: str, warmup: list[list[int]], **features):
    engine = MiniInferSystem(model_dir, dict(dtype=dtype, **features)).engine
    for i, prompt in enumerate(warmup):
        engine.add_request(f"warm-{i}", prompt, greedy(4, DELTA))
    list(engine.run_until_done())
    return engine


def run_shared_prefix(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream = load_stream(model_dir)
    system = stream.window(0, SYSTEM_LEN)
    prompts = [system + stream.window(1 + 37 * i, QUESTION_LEN) for i in range(NUM_QUESTIONS)]
    settings = {}
    for name, caching in (("caching off", False), ("caching on", True)):
        engine = _warm_engine(model_dir, options.dtype, [stream.window(900 + 53 * i, 64) for i in range(4)],
                              enable_prefix_caching=caching)
        first, done = {}, {}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(ANSWER_LEN, DELTA))
        for output in engine.run_until_done():
            now = time.perf_counter() - start
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, now)
            if output.finished:
                done[output.request_id] = now
        wall, ttft = max(done.values()), list(first.values())
        settings[name] = {"ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
                          "ttft_p99_s": percentile(ttft, 99), "wall_s": wall,
                          "output_tok_s": NUM_QUESTIONS * ANSWER_LEN / wall,
                          "prefix_queries": engine.kv_cache.prefix_queries, "prefix_hits": engine.kv_cache.prefix_hits}
        engine.shutdown()
        log(f"shared-prefix {name}: TTFT p50 {settings[name]['ttft_p50_s']:.2f} s, "
            f"{settings[name]['output_tok_s']:.1f} output tok/s")
    config = {"model": model_dir, "dtype": options.dtype, "system_len": SYSTEM_LEN, "question_len": QUESTION_LEN,
              "num_requests": NUM_QUESTIONS, "output_len": ANSWER_LEN}
    return {"workload": "shared-prefix", "config": config, "settings": settings}


def run_long_prompt(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream = load_stream(model_dir)
    streams = [stream.window(3 + 41 * i, STREAM_PROMPT_LEN) for i in range(NUM_STREAMS)]
    longs = [stream.window(500 + 97 * i, n) for i, n in enumerate(LONG_PROMPT_LENS)]
    last_stream = f"s{NUM_STREAMS - 1}"
    settings = {}
    for name, chunked, target in (("chunked off", False, None), ("chunked on", True, None),
                                  (f"on, step target {SERVE_TARGET_ITL_MS:g} ms", True, SERVE_TARGET_ITL_MS)):
        engine = _warm_engine(model_dir, options.dtype, [stream.window(900, 64)], enable_chunked_prefill=chunked,
                              target_itl_ms=target)
        for i, prompt in enumerate(streams):
            engine.add_request(f"s{i}", prompt, greedy(STREAM_LEN, DELTA))
        last, gaps, pending, decode_steps = {}, [], list(enumerate(longs)), 0
        start = time.perf_counter()
        for output in engine.run_until_done():
            now, rid = time.perf_counter(), output.request_id
            if not (rid.startswith("s") and output.outputs[0].token_ids):
                continue
            if rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
            # The step loop does not mark step boundaries, so the streams' tokens are the clock: the last
            # stream's token ends a decode step, and a request added now joins the next one.
            if rid == last_stream and len(last) == NUM_STREAMS:
                decode_steps += 1
                if pending and (decode_steps - 1) % LONG_EVERY_STEPS == 0:
                    i, prompt = pending.pop(0)
                    engine.add_request(f"long{i}", prompt, greedy(1, DELTA))
        settings[name] = {"itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
                          "itl_max_s": max(gaps), "itl_mean_s": sum(gaps) / len(gaps), "num_gaps": len(gaps),
                          "wall_s": time.perf_counter() - start, "long_prompts_added": len(longs) - len(pending),
                          "max_num_batched_tokens": engine.config.max_num_batched_tokens, "target_itl_ms": target}
        engine.shutdown()
        log(f"long-prompt {name}: ITL p50 {1000 * settings[name]['itl_p50_s']:.0f} ms, "
            f"p99 {1000 * settings[name]['itl_p99_s']:.0f} ms")
    config = {"model": model_dir, "dtype": options.dtype, "streams": NUM_STREAMS, "stream_prompt_len":
              STREAM_PROMPT_LEN, "stream_output_len": STREAM_LEN, "long_prompt_lens": list(LONG_PROMPT_LENS),
              "long_every_steps": LONG_EVERY_STEPS}
    return {"workload": "long-prompt", "config": config, "settings": settings}


def _setting_rows(report: dict) -> list[dict]:
    return [{"setting": name, **values} for name, values in report["settings"].items()]


def _p50_p99_chart(metric: str, ylabel: str) -> Callable[[dict], tuple[str, list[Panel]]]:
    """The settings side by side: p50 and p99 of `metric` (seconds, plotted in ms)."""
    def chart(report: dict) -> tuple[str, list[Panel]]:
        names, settings = list(report["settings"]), report["settings"]
        series = [Series(q, [1000 * settings[n][f"{metric}_{q}_s"] for n in names]) for q in ("p50", "p99")]
        return (f"{report['workload']}: {Path(report['config']['model']).name}, {report['config']['dtype']}",
                [Panel(ylabel, names, series)])

    return chart


def _ms(header: str, key: str) -> Column:
    return Column(header, key, "{:.0f}", 1e3)


SHARED_PREFIX_HEADLINE = ("{model} ({dtype}): {num_requests} requests at once, a shared {system_len}-token system "
                          "prompt + a {question_len}-token question each, {output_len} new tokens")
LONG_PROMPT_HEADLINE = ("{model} ({dtype}): {streams} streams ({stream_prompt_len} prompt + {stream_output_len} new "
                        "tokens) decoding while prompts of {long_prompt_lens} tokens arrive every {long_every_steps} "
                        "steps")
SHARED_PREFIX = Workload(run_shared_prefix, lambda report: [SHARED_PREFIX_HEADLINE.format_map(report["config"])], (
    Column("prefix caching", "setting"), _ms("TTFT mean ms", "ttft_mean_s"), _ms("p50 ms", "ttft_p50_s"),
    _ms("p99 ms", "ttft_p99_s"), Column("out tok/s", "output_tok_s", "{:.1f}"), Column("wall s", "wall_s", "{:.1f}"),
    Column("hit/query tokens", None, "{0[prefix_hits]}/{0[prefix_queries]}")),
    _setting_rows, _p50_p99_chart("ttft", "time to first token (ms)"))
LONG_PROMPT = Workload(run_long_prompt, lambda report: [LONG_PROMPT_HEADLINE.format_map(report["config"])], (
    Column("chunked prefill", "setting"), Column("step budget", "max_num_batched_tokens"),
    Column("target ms", "target_itl_ms", "{:g}"), _ms("ITL p50 ms", "itl_p50_s"), _ms("p99 ms", "itl_p99_s"),
    _ms("max ms", "itl_max_s"),
    _ms("mean ms", "itl_mean_s"), Column("wall s", "wall_s", "{:.1f}")),
    _setting_rows, _p50_p99_chart("itl", "inter-token latency of the streams (ms)"))
