"""The llama.cpp peer's worker, run by its environment's Python: llama-cpp-python's low-level batch API, one
sequence id per request, every unfinished request decoded together each step, greedy argmax per sequence."""

from __future__ import annotations

import ctypes
import time

import llama_cpp
import numpy as np
from worker_protocol import serve

KV_CELLS_PER_SEQ_MULTIPLE = 256  # llama.cpp rounds each sequence's share of the context up to this


def load(settings: dict):
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(settings["model"].encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {settings['model']}")
    params = llama_cpp.llama_context_default_params()
    max_seqs, per_seq = settings["max_seqs"], settings["max_seq_len"]
    per_seq = -(-per_seq // KV_CELLS_PER_SEQ_MULTIPLE) * KV_CELLS_PER_SEQ_MULTIPLE
    params.n_ctx, params.n_seq_max = max_seqs * per_seq, max_seqs
    params.n_batch = params.n_ubatch = settings["batch_tokens"]
    params.n_threads = params.n_threads_batch = settings["threads"]
    params.no_perf = True
    if settings["kv_f32"]:
        params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        raise RuntimeError("llama.cpp could not create its context")
    decoder = Decoder(model, context, settings["batch_tokens"], max_seqs)
    ready = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip(),
             "n_ctx": llama_cpp.llama_n_ctx(context), "n_batch": params.n_batch}
    return ready, decoder.run


class Decoder:
    def __init__(self, model, context, batch_tokens: int, max_seqs: int) -> None:
        self.context, self.batch_tokens, self.max_seqs = context, batch_tokens, max_seqs
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(batch_tokens, 0, 1)

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> dict:
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} requests, the context holds {self.max_seqs} sequences")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context), True)
        start = time.perf_counter()
        # Prefill: every prompt's tokens, the logits of each one's last; split where they exceed a batch.
        entries = [(seq, pos, token, pos == len(prompt) - 1)
                   for seq, prompt in enumerate(prompts) for pos, token in enumerate(prompt)]
        last = {}
        for first in range(0, len(entries), self.batch_tokens):
            last.update(self._decode(entries[first:first + self.batch_tokens]))
        token_ids, finish_s = [[] for _ in prompts], [0.0] * len(prompts)
        while last:
            for seq, token in last.items():
                token_ids[seq].append(token)
                if len(token_ids[seq]) == output_lens[seq]:
                    finish_s[seq] = time.perf_counter() - start
            step = [(seq, len(prompts[seq]) + len(token_ids[seq]) - 1, token, True) for seq, token in last.items()
                    if len(token_ids[seq]) < output_lens[seq]]
            last = self._decode(step) if step else {}
        return {"token_ids": token_ids, "finish_s": finish_s, "wall_s": time.perf_counter() - start}

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """One llama_decode of (sequence, position, token, wants logits) entries; the argmax token of each
        sequence whose logits were asked for."""
        batch = self.batch
        for i, (seq, pos, token, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants_logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        code = llama_cpp.llama_decode(self.context, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {len(entries)} tokens")
        chosen = {}
        for i, (seq, _, _, wants_logits) in enumerate(entries):
            if wants_logits:
                logits = ctypes.cast(llama_cpp.llama_get_logits_ith(self.context, i),
                                     ctypes.POINTER(ctypes.c_float * self.vocab_size)).contents
                chosen[seq] = int(np.frombuffer(logits, dtype=np.float32).argmax())
        return chosen


if __name__ == "__main__":
    serve(load)
