"""Two workloads that measure a scheduler feature against the same engine without it (mini-infer only, each
setting on a fresh engine, after a warm-up on unrelated prompts):

- shared-prefix: 32 requests sharing a 512-token system prompt, each with its own 32-token question, submitted at
  once; time to first token and output throughput, prefix caching on vs off.
- long-prompt: 8 streams decoding while 4 long prompts (1-2k tokens) arrive one after another; the inter-token
  latency of the 8 streams, chunked prefill on vs off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import load_stream
from mini_infer.bench.report import describe_machine, format_table, percentile

SYSTEM_LEN, QUESTION_LEN, NUM_QUESTIONS, ANSWER_LEN = 512, 32, 32, 32
NUM_STREAMS, STREAM_PROMPT_LEN, STREAM_LEN = 8, 32, 128
LONG_PROMPT_LENS, LONG_EVERY_STEPS = (1024, 2048, 1536, 1024), 16


def _engine(model_dir: str, dtype: str, **features):
    from mini_infer import LLM

    return LLM(model_dir, dtype=dtype, **features).engine


def _params(max_tokens: int):
    from mini_infer import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def _drain(engine, on_output: Callable) -> None:
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            on_output(output, now)


def run_shared_prefix(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream = load_stream(model_dir)
    system = stream.window(0, SYSTEM_LEN)
    prompts = [system + stream.window(1 + 37 * i, QUESTION_LEN) for i in range(NUM_QUESTIONS)]
    warmup = [stream.window(900 + 53 * i, 64) for i in range(4)]
    settings = {}
    for name, caching in (("caching off", False), ("caching on", True)):
        engine = _engine(model_dir, options.dtype, enable_prefix_caching=caching)
        for i, prompt in enumerate(warmup):
            engine.add_request(f"warm-{i}", prompt, _params(4))
        _drain(engine, lambda output, now: None)
        first, done = {}, {}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, _params(ANSWER_LEN))

        def seen(output, now, first=first, done=done):
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, now - start)
            if output.finished:
                done[output.request_id] = now - start

        _drain(engine, seen)
        wall = max(done.values())
        ttft = list(first.values())
        settings[name] = {"ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
                          "ttft_p99_s": percentile(ttft, 99), "wall_s": wall,
                          "output_tok_s": NUM_QUESTIONS * ANSWER_LEN / wall,
                          "prefix_queries": engine.kv_cache.prefix_queries,
                          "prefix_hits": engine.kv_cache.prefix_hits}
        log(f"shared-prefix {name}: TTFT p50 {settings[name]['ttft_p50_s']:.2f} s, "
            f"{settings[name]['output_tok_s']:.1f} output tok/s")
        del engine
    config = {"model": model_dir, "dtype": options.dtype, "system_len": SYSTEM_LEN, "question_len": QUESTION_LEN,
              "num_requests": NUM_QUESTIONS, "output_len": ANSWER_LEN}
    return {"workload": "shared-prefix", "config": config, "settings": settings}


def run_long_prompt(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    stream = load_stream(model_dir)
    streams = [stream.window(3 + 41 * i, STREAM_PROMPT_LEN) for i in range(NUM_STREAMS)]
    longs = [stream.window(500 + 97 * i, n) for i, n in enumerate(LONG_PROMPT_LENS)]
    settings = {}
    for name, chunked in (("chunked off", False), ("chunked on", True)):
        engine = _engine(model_dir, options.dtype, enable_chunked_prefill=chunked)
        engine.add_request("warm", stream.window(900, 64), _params(4))
        _drain(engine, lambda output, now: None)
        last, gaps, step_count = {}, [], 0
        for i, prompt in enumerate(streams):
            engine.add_request(f"s{i}", prompt, _params(STREAM_LEN))
        pending = list(enumerate(longs))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            decoding = len(last) == NUM_STREAMS
            if decoding and pending and step_count % LONG_EVERY_STEPS == 0:
                i, prompt = pending.pop(0)
                engine.add_request(f"long{i}", prompt, _params(1))
            outputs = engine.step()
            now = time.perf_counter()
            step_count += decoding
            for output in outputs:
                rid = output.request_id
                if rid.startswith("s") and output.outputs[0].token_ids:
                    if rid in last:
                        gaps.append(now - last[rid])
                    last[rid] = now
        settings[name] = {"itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
                          "itl_max_s": max(gaps), "itl_mean_s": sum(gaps) / len(gaps), "num_gaps": len(gaps),
                          "wall_s": time.perf_counter() - start, "long_prompts_added": len(longs) - len(pending),
                          "max_num_batched_tokens": engine.config.max_num_batched_tokens}
        log(f"long-prompt {name}: ITL p50 {1000 * settings[name]['itl_p50_s']:.0f} ms, "
            f"p99 {1000 * settings[name]['itl_p99_s']:.0f} ms")
        del engine
    config = {"model": model_dir, "dtype": options.dtype, "streams": NUM_STREAMS, "stream_prompt_len":
              STREAM_PROMPT_LEN, "stream_output_len": STREAM_LEN, "long_prompt_lens": list(LONG_PROMPT_LENS),
              "long_every_steps": LONG_EVERY_STEPS}
    return {"workload": "long-prompt", "config": config, "settings": settings}


def shared_prefix_table(report: dict) -> str:
    config, settings = report["config"], report["settings"]
    lines = [f"{config['model']} ({config['dtype']}): {config['num_requests']} requests at once, a shared "
             f"{config['system_len']}-token system prompt + a {config['question_len']}-token question each, "
             f"{config['output_len']} new tokens", describe_machine(report["machine"]), ""]
    rows = [[name, f"{1000 * s['ttft_mean_s']:.0f}", f"{1000 * s['ttft_p50_s']:.0f}", f"{1000 * s['ttft_p99_s']:.0f}",
             f"{s['output_tok_s']:.1f}", f"{s['wall_s']:.1f}", f"{s['prefix_hits']}/{s['prefix_queries']}"]
            for name, s in settings.items()]
    lines.append(format_table(["prefix caching", "TTFT mean ms", "p50 ms", "p99 ms", "out tok/s", "wall s",
                               "hit/query tokens"], rows))
    return "\n".join(lines)


def long_prompt_table(report: dict) -> str:
    config, settings = report["config"], report["settings"]
    lines = [f"{config['model']} ({config['dtype']}): {config['streams']} streams ({config['stream_prompt_len']} "
             f"prompt + {config['stream_output_len']} new tokens) decoding while prompts of "
             f"{config['long_prompt_lens']} tokens arrive every {config['long_every_steps']} steps",
             describe_machine(report["machine"]), ""]
    rows = [[name, s["max_num_batched_tokens"], f"{1000 * s['itl_p50_s']:.0f}", f"{1000 * s['itl_p99_s']:.0f}",
             f"{1000 * s['itl_max_s']:.0f}", f"{1000 * s['itl_mean_s']:.0f}", f"{s['wall_s']:.1f}"]
            for name, s in settings.items()]
    lines.append(format_table(["chunked prefill", "step budget", "ITL p50 ms", "p99 ms", "max ms", "mean ms",
                               "wall s"], rows))
    return "\n".join(lines)
