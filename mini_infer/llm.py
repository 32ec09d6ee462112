"""LLM: the offline batch API (vLLM's `LLM.generate` / `LLM.chat`, and a pooling model's `LLM.embed` / `LLM.score`)
on top of LLMEngine."""

from __future__ import annotations

import itertools
from dataclasses import replace
from collections.abc import Sequence

from tqdm.auto import tqdm

from mini_infer.config import EngineConfig
from mini_infer.engine.input_processor import PromptType
from mini_infer.engine.data_parallel import create_engine
from mini_infer.engine.scoring import PairSide, cosine_similarities, distinct, pair_prompt, score_pairs
from mini_infer.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                                ScoringRequestOutput)
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        """engine_args: the EngineConfig fields (dtype, device, block_size, max_num_seqs, cpu_kernels,
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size, ...)."""
        self.engine = create_engine(EngineConfig(model=str(model), **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        request_ids = self._add_all(prompts, sampling_params)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (the model's, or `chat_template`; chat_template_kwargs
        are the template's variables, e.g. {"enable_thinking": False}), then generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError(f"{self.engine.config.model} has no tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tokenizer.apply_chat_template(c, tools=tools, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """An embedding model's (task embed) embedding of every prompt, in input order: `outputs.embedding`."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, pooling_params), use_tqdm)

    def score(self, text_1: PairSide, text_2: PairSide, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Scores of (text_1, text_2) pairs, as vLLM's: one text_1 against each text_2 (1:1, 1:N), or equally long
        lists paired in order (N:N); texts or token ids. A reranker (task score) scores each pair's joined prompt;
        an embedding model (task embed), the cosine similarity of the two embeddings."""
        pairs = score_pairs(text_1, text_2)
        if self.engine.config.task == "embed":
            unique, index = distinct([item for pair in pairs for item in pair])
            embedded = self.embed(unique, pooling_params, use_tqdm)
            outputs = [embedded[i] for i in index]  # first, second, first, second, ...
            scores = cosine_similarities([o.outputs.embedding for o in outputs[0::2]],
                                         [o.outputs.embedding for o in outputs[1::2]])
            return [ScoringRequestOutput(f"{a.request_id}+{b.request_id}", ScoringOutput(score),
                                         a.prompt_token_ids + b.prompt_token_ids)
                    for a, b, score in zip(outputs[0::2], outputs[1::2], scores)]
        tokenizer = self.get_tokenizer()
        prompts = [pair_prompt(tokenizer, a, b) for a, b in pairs]
        return self._run(self._add_all(prompts, [pooling_params or PoolingParams()] * len(prompts)), use_tqdm)

    def _add_all(self, prompts, params_list) -> list[str]:
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except BaseException as e:
            # The batch fails as a whole, before any of it runs; the engine keeps nothing of it.
            self.engine.abort_request(request_ids)
            if isinstance(e, ValueError):
                raise ValueError(f"prompt {len(request_ids)}: {e}") from e
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        num_output_tokens = 0
        for output in self.engine.run_until_done():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                finished[output.request_id] = output
                if isinstance(output, RequestOutput):
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.set_postfix_str(f"{num_output_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} out tok/s")
                bar.update(1)
        bar.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
