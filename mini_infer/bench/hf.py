"""The HF transformers baselines: `generate` on static left-padded batches, and transformers' continuous batching.

Imported only when an HF system is selected: nothing else in mini-infer loads transformers' modeling code.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from mini_infer.bench.report import RunResult

CONTINUOUS_PAGE_SIZE = 256  # transformers' default page size, in tokens
CONTINUOUS_MAX_BATCH_TOKENS = 1024


def load_model(model_dir: str, dtype: str, device: str = "cpu"):
    """The checkpoint as a transformers model on `device`, its generation defaults replaced by plain greedy decoding
    (the checkpoint's own sampling defaults, e.g. repetition_penalty 1.1, would change what is computed)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    checkpoint = model.generation_config
    eos = checkpoint.eos_token_id
    first_eos = eos[0] if isinstance(eos, list) else eos
    pad = checkpoint.pad_token_id if checkpoint.pad_token_id is not None else first_eos
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=eos,
                                               pad_token_id=pad if pad is not None else 0)
    return model


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a batch, padded on the left as decoder-only generation needs."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


class HFGenerate:
    """`model.generate` on static batches in submission order (all at once when batch_size is None); a batch
    runs until its longest request is done, and each request keeps its own output length of it."""

    name = "hf-generate"

    def __init__(self, model, batch_size: int | None) -> None:
        self.model, self.batch_size = model, batch_size

    def run(self, prompts: list[list[int]], output_lens: list[int], temperature: float = 0.0) -> RunResult:
        start = time.perf_counter()
        token_ids, finish_s = [], []
        step = self.batch_size or len(prompts)
        for first in range(0, len(prompts), step):
            batch_lens = output_lens[first:first + step]
            generated = self._generate(prompts[first:first + step], max(batch_lens), temperature)
            token_ids += [ids[:n] for ids, n in zip(generated, batch_lens)]
            finish_s += [time.perf_counter() - start] * len(batch_lens)
        return RunResult(token_ids, finish_s, time.perf_counter() - start)

    def _generate(self, prompts: list[list[int]], num_new: int, temperature: float) -> list[list[int]]:
        input_ids, attention_mask = (t.to(self.model.device) for t in left_pad(
            prompts, self.model.generation_config.pad_token_id))
        sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature else {}
        # min_new_tokens = max_new_tokens: EOS can never end a row early, so every row generates num_new.
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                                      min_new_tokens=num_new, **sampling)
        return out[:, input_ids.shape[1]:].tolist()

    def close(self) -> None:
        pass


class HFContinuous:
    """transformers' continuous batching (a paged cache served by a background thread), every request submitted
    at once with its own max_new_tokens; a request finishes when its result reaches this thread."""

    name = "hf-continuous"

    def __init__(self, model, max_requests: int, max_seq_len: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model = model
        # eos_token_id -1 turns EOS off: every request runs to its max_new_tokens.
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1,
                                                  pad_token_id=model.generation_config.pad_token_id)
        # Sized for the largest run up front: the manager persists between runs and keeps its first sizing.
        self.cb_config = ContinuousBatchingConfig(
            page_size=CONTINUOUS_PAGE_SIZE, max_batch_tokens=CONTINUOUS_MAX_BATCH_TOKENS,
            num_blocks=max_requests * math.ceil(max_seq_len / CONTINUOUS_PAGE_SIZE))
        # Its CPU memory probe logs an error without psutil although num_blocks is given; real failures
        # reach run() as request errors or a dead generation thread, and are raised there.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    def run(self, prompts: list[list[int]], output_lens: list[int], temperature: float = 0.0) -> RunResult:
        if temperature:
            raise ValueError("hf-continuous runs greedy here; use hf-generate for a sampled workload")
        start = time.perf_counter()
        token_ids, finish_s = [[] for _ in prompts], [0.0] * len(prompts)
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation_config, continuous_batching_config=self.cb_config,
                persistent_manager=True, warmup=False) as manager:
            index = {}
            for i, (prompt, output_len) in enumerate(zip(prompts, output_lens)):
                request_id = manager.add_request(prompt, max_new_tokens=output_len)
                if request_id is None:
                    raise RuntimeError("the continuous batching manager refused a request")
                index[request_id] = i
            while index:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"the generation thread stopped: "
                                           f"{manager.background_thread_status.fatal_error}")
                    continue
                if not result.is_finished():
                    continue
                if result.error is not None:
                    raise RuntimeError(f"request failed: {result.error}")
                i = index.pop(result.request_id)
                token_ids[i], finish_s[i] = list(result.generated_tokens), time.perf_counter() - start
            end = time.perf_counter()
        return RunResult(token_ids, finish_s, end - start)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
