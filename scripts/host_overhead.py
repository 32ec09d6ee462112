"""Host-side time of a decode step (input preparation + sampling + scheduler) at batch 1 and 16, context 128 and
2048, from bench.profile's profile_decode_step, with repetition_penalty 1.1 forced into the profiled requests (so
that it also runs on checkouts whose profile has no --repetition-penalty). One torch thread, float32.

    python scripts/host_overhead.py MODEL_DIR OUT_JSON      # e.g. a `mini-infer make-model --preset tiny` dir
    cd OLD_CHECKOUT && PYTHONPATH=. python /path/to/scripts/host_overhead.py MODEL_DIR OUT_JSON
"""
import json
import sys

import torch

import mini_infer.bench.profile as prof
from mini_infer.config import EngineConfig
from mini_infer.engine.llm_engine import LLMEngine

real = prof.SamplingParams
prof.SamplingParams = lambda **kw: real(**{**kw, "repetition_penalty": 1.1})
torch.set_num_threads(1)
model, out = sys.argv[1], sys.argv[2]
results = []
for batch in (1, 16):
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_num_batched_tokens=4096 * 16,
                                    enable_chunked_prefill=False, max_model_len=4096, enable_prefix_caching=False))
    for context in (128, 2048):
        r = prof.profile_decode_step(engine, batch, prompt_len=context - 64, decode_steps_before=63, steps=10)
        rows = {row["name"]: row["ms"] for row in r["rows"]}
        host = rows["input preparation"] + rows["sampling"] + rows["scheduler / bookkeeping"]
        results.append({"batch": batch, "context": r["context_len"], "host_ms": host, "step_ms": r["step_ms"],
                        "unprofiled_step_ms": r["unprofiled_step_ms"], **{k: rows[k] for k in
                        ("input preparation", "sampling", "scheduler / bookkeeping")}})
        print(json.dumps(results[-1]), flush=True)
json.dump(results, open(out, "w"), indent=1)
