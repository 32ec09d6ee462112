"""LLM: the offline batch API (vLLM's `LLM.generate` / `LLM.chat`) on top of LLMEngine."""

from __future__ import annotations

import itertools
from dataclasses import replace
from collections.abc import Sequence

from tqdm.auto import tqdm

from mini_infer.config import EngineConfig
from mini_infer.engine.input_processor import PromptType
from mini_infer.engine.data_parallel import create_engine
from mini_infer.outputs import RequestOutput
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

    def _add_all(self, prompts, sampling_params) -> list[str]:
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                if params.output_kind is not RequestOutputKind.FINAL_ONLY:
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

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        num_output_tokens = 0
        for output in self.engine.run_until_done():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                finished[output.request_id] = output
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
