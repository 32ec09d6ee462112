"""Pickled size of a decode step's plan at B=64 (what rank 0 sends every other rank), at context 128 and 2048.

    python scripts/plan_size.py MODEL_DIR      # e.g. a `mini-infer make-model --preset tiny` dir
"""
import pickle
import sys

from mini_infer import LLMEngine, SamplingParams
engine = LLMEngine.from_args(sys.argv[1], dtype="float32", max_num_seqs=64, max_model_len=4096,
                             max_num_batched_tokens=8192, enable_prefix_caching=False)
params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, repetition_penalty=1.1)
for context in (128, 2048):
    for i in range(64):
        engine.add_request(f"{context}-{i}", [(17 * i + j) % 1000 + 1 for j in range(context - 64)], params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    sizes = []
    for _ in range(64):
        plan = engine.scheduler.schedule()
        sizes.append(len(pickle.dumps(plan)))
        engine._process(plan, engine._execute(plan))
    print(f"B=64 decode, context {context}..{context + 64}: plan {min(sizes)}-{max(sizes)} bytes "
          f"(mean {sum(sizes) / len(sizes):.0f}) = {sum(sizes) / len(sizes) / 64:.1f} bytes per request")
    engine.abort_request(list(engine.requests))
    list(engine.run_until_done())
