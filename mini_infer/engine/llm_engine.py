"""LLMEngine: add_request / step / abort_request over the scheduler, the model runner and detokenization.

Bad requests are refused by add_request with a ValueError naming the field and its allowed range; nothing
of them reaches the scheduler, so the engine keeps serving everything else. A pooling model's engine (task embed or
score) takes PoolingParams requests: each is prefilled through the same scheduler (chunked, preempted, from the
prefix cache where its pooling allows) and finishes with one EmbeddingRequestOutput or ScoringRequestOutput.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from mini_infer.config import EngineConfig
from mini_infer.engine.client import EngineClient
from mini_infer.engine.detokenizer import IncrementalDetokenizer, load_tokenizer, raw_decoder
from mini_infer.engine.group import RequestGroup, child_id, child_params
from mini_infer.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.engine.scheduler import Scheduler, SchedulerStats, StepUpdate
from mini_infer.engine.step_cost import OnlineStepCost
from mini_infer.errors import InvalidRequestError
from mini_infer.executor.executor import create_executor
from mini_infer.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from mini_infer.pooling_params import PoolingParams
from mini_infer.profiling import profiled
from mini_infer.runner.model_runner import LaunchedStep, ModelRunner
from mini_infer.runner.plan import StepPlan
from mini_infer.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr


class LLMEngine(EngineClient):
    """One engine replica: the scheduler and sampler here, the model on this process alone or, with tensor or
    pipeline parallelism, over ranks this process leads as rank 0 (data_parallel_size is for
    mini_infer.engine.data_parallel.create_engine, which starts replicas of this). A step is schedule -> execute ->
    update -> outputs."""

    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size != 1:
            raise ValueError("LLMEngine is one replica; build data_parallel_size > 1 with "
                             "mini_infer.engine.data_parallel.create_engine (LLM does)")
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_dir)
        freeze_startup_heap()  # (before the engine's own objects: a cycle among those stays collectable)
        self._decode = raw_decoder(self.tokenizer) if self.tokenizer is not None else None
        num_blocks = config.resolved_num_kv_blocks()
        self.processor = InputProcessor(config, self.tokenizer, num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.max_num_seqs, config.max_blocks_per_seq,
                                       enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   vocab_size=config.model_config.vocab_size, speculative=config.speculative_config,
                                   max_model_len=config.max_model_len, draft_cost_prior=config.draft_cost_prior,
                                   **_step_target(config))
        self.executor = create_executor(config, num_blocks)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, RequestGroup] = {}  # requests of n > 1, by their id (their children are in requests)
        self._child_groups: dict[str, str] = {}  # child request id -> its group's
        self._aborted_outputs: list[RequestOutput | PoolingRequestOutput] = []
        # Async scheduling (EngineConfig.async_scheduling, resolved once): the step still running on the device, with
        # its plan.
        self._runs_ahead = config.runs_ahead
        self._in_flight: tuple[StepPlan, LaunchedStep | None] | None = None

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (its batch, caches and sampler)."""
        return self.executor.runner

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling defaults of the model's generation_config.json, as vLLM does."""
        return self.processor.default_sampling_params()

    # ---- requests in ----

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None) -> None:
        """Queue a request; with params.n > 1 its n completions run as child requests (engine/group.py)."""
        self.add_processed(request_id, self.processor.process(prompt, params))

    def add_processed(self, request_id: str, processed: ProcessedRequest) -> None:
        text, token_ids, params, max_tokens = (processed.text, processed.token_ids, processed.params,
                                               processed.max_tokens)
        if isinstance(params, PoolingParams):
            self._check_free(request_id)
            request = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params,
                              max_tokens=0, eos_token_ids=frozenset(), detokenizer=None,
                              whole_prompt=self.config.pooler.pooling_type == "mean")
            self.requests[request_id] = request
            self.scheduler.add(request)
            return
        count = params.num_samples
        if count > params.n:  # best_of: the best are known only at the end, so that is when they come
            params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        ids = [request_id] if count == 1 else [child_id(request_id, i) for i in range(count)]
        for rid in {request_id, *ids}:
            self._check_free(rid)
        requests = [self._request(rid, text, token_ids, params if count == 1 else child_params(params, i),
                                  max_tokens, i, request_id if count > 1 else None, processed.grammar)
                    for i, rid in enumerate(ids)]
        for request in requests:
            self.requests[request.request_id] = request
        if count > 1:
            # The first child computes the prompt; the others wait for its blocks to be cached (without a prefix
            # cache there is nothing to wait for).
            waiting = requests[1:] if self.config.enable_prefix_caching else []
            self.groups[request_id] = RequestGroup(request_id, params.output_kind, params.n,
                                                   params.logprobs is not None, ids, waiting)
            self._child_groups.update((cid, request_id) for cid in ids)
            requests = requests[:1] if waiting else requests
        for request in requests:
            self.scheduler.add(request)

    def _check_free(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.groups:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by an unfinished request",
                                      "request_id")

    def _request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                 max_tokens: int, index: int, group_id: str | None,
                 grammar: xgr.CompiledGrammar | None) -> Request:
        detokenizer = (IncrementalDetokenizer(self.tokenizer, params, self._decode) if self.tokenizer is not None
                       else None)
        request = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params,
                          max_tokens=max_tokens, eos_token_ids=frozenset() if params.ignore_eos
                          else self.processor.eos_token_ids, detokenizer=detokenizer, index=index, group_id=group_id)
        if grammar is not None:  # the request's compiled structured-output grammar
            # It may end on the model's EOS even with ignore_eos: a grammar that has ended ends its request.
            request.grammar = self.processor.grammars.matcher(
                grammar, (*self.processor.eos_token_ids, *params.stop_token_ids))
        return request

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort unfinished requests (unknown or finished ids are ignored; a request of n > 1 with all its
        completions); their blocks return at once and the next step() reports each with finish_reason "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self.groups.get(rid)
            waiting = {request.request_id for request in group.waiting} if group else set()
            for cid in group.children if group else [rid]:
                request = self.requests.pop(cid, None)
                if request is None:
                    continue
                if cid in waiting:  # never scheduled
                    request.status = RequestStatus.FINISHED_ABORTED
                else:
                    self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                self._aborted_outputs.append(_pooling_output(self.config.task, request, None) if request.pooling
                                             else _make_output(request))
            if group is not None:
                group.waiting.clear()

    # ---- the loop ----

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one scheduled step; return the outputs of the requests it advanced (and of aborted ones).

        With async scheduling the step is launched and left running on the device: the next call schedules and
        launches the one after it (its requests' sampled tokens pending) before it collects this one's tokens and
        makes its outputs, so that the host's work overlaps the device's. A step that needs the tokens before it
        (Scheduler.can_run_ahead) waits for them first."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        running, self._in_flight = self._in_flight, None
        if running is not None and not self.scheduler.can_run_ahead():
            outputs += self._finish(*running)
            running = None
        with profiled("scheduler"):
            plan = self.scheduler.schedule(run_ahead=running is not None)
        launched = None
        if plan.request_ids or plan.finished_ids or plan.preempted_ids:  # (a plan may only say who left)
            launched = plan, self.executor.launch(plan)
        if running is not None:
            outputs += self._finish(*running)
        if launched is not None:
            if self._runs_ahead and plan.request_ids:
                self._in_flight = launched
            else:
                outputs += self._finish(*launched)
        return self._grouped(outputs)

    def _finish(self, plan: StepPlan, launched: LaunchedStep | None) -> list[RequestOutput | PoolingRequestOutput]:
        """A launched step's outputs, once its tokens are in."""
        sampled = self.executor.collect(launched)
        with profiled("scheduler"):
            return self._outputs(self.scheduler.update(plan, sampled))

    def _outputs(self, update: StepUpdate) -> list[RequestOutput | PoolingRequestOutput]:
        """The step's outputs: each request that sampled, its logprobs recorded (a group's first completion's first
        token lets the rest of the group start), and each pooling request with its value; the finished ones dropped
        from the engine's books."""
        for request_id, (first, scored) in update.prompt_logprobs.items():
            self._record_prompt_logprobs(self.requests[request_id], first, scored)
        outputs: list[RequestOutput | PoolingRequestOutput] = [
            _pooling_output(self.config.task, request, value) for request, value in update.pooled]
        for request, token_id, logprobs in update.sampled:
            if request.group_id is not None and request.num_output_tokens == 1 and request.index == 0:
                self._release_waiting_children(request.group_id)
            if logprobs is not None:
                self._record_logprobs(request, token_id, logprobs)
            output = _make_output(request)
            if output is not None:
                outputs.append(output)
        for request in update.finished:
            del self.requests[request.request_id]
        return outputs

    def _grouped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs with each group's children merged into one output of the group (dropped where it
        has nothing to report yet)."""
        if not self._child_groups:  # no request of n > 1 in flight: nothing to merge
            return outputs
        merged, children = [], {}
        for output in outputs:
            group_id = self._child_groups.get(output.request_id)
            if group_id is None:
                merged.append(output)
            else:
                children.setdefault(group_id, []).append(output)
        for group_id, outs in children.items():
            group = self.groups[group_id]
            output = group.merge(outs)
            if output is not None:
                merged.append(output)
            if group.done:
                del self.groups[group_id]
                for cid in group.children:
                    del self._child_groups[cid]
        return merged

    def _release_waiting_children(self, group_id: str) -> None:
        """The group's first child has computed the prompt (its blocks are cached): the others may start."""
        group = self.groups[group_id]
        for request in group.waiting:
            self.scheduler.add(request)
        group.waiting.clear()

    def _record_logprobs(self, request: Request, token_id: int, logprobs) -> None:
        logprob, rank, top_ids, top_values = logprobs
        request.logprobs.append(self._logprob_entry(token_id, logprob, rank, top_ids, top_values))
        request.cumulative_logprob += logprob

    def _record_prompt_logprobs(self, request: Request, first: int, scored: list) -> None:
        """Prompt positions first.. of a step's prompt logprobs (a recompute after preemption finds them kept)."""
        for position, (token_id, *logprobs) in enumerate(scored, start=first):
            if request.prompt_logprobs[position] is None:
                request.prompt_logprobs[position] = self._logprob_entry(token_id, *logprobs)

    def _logprob_entry(self, token_id: int, logprob: float, rank: int, top_ids: list[int],
                       top_values: list[float]) -> dict[int, Logprob]:
        """One position's logprobs: its token's first, then the top-N not already there."""
        entry = {token_id: Logprob(logprob, rank, self._decode_token(token_id))}
        for i, (tid, value) in enumerate(zip(top_ids, top_values)):
            entry.setdefault(tid, Logprob(value, i + 1, self._decode_token(tid)))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    # ---- state ----

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def check_health(self) -> None:
        """Raise WorkerDiedError if the engine has failed or one of its worker ranks has exited."""
        self.executor.check_health()

    def memory_stats(self) -> list[dict]:
        """Per rank: parameter bytes, KV bytes and peak memory (see ModelRunner.memory_stats)."""
        return self.executor.memory_stats()

    def shutdown(self) -> None:
        """Stop the worker ranks (a single-process engine has none)."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then move every object alive into the permanent generation that the cyclic
    collector never scans (gc.freeze; vLLM does the same after start-up). With its imports and tokenizer a process
    holds ~200k tracked objects (torch's and transformers' modules, the tokenizer wrapper; an engine adds ~700); the
    steps' own objects (outputs, plan entries) trigger a full collection every ~25 steps at batch 256, and each
    scanned them all: ~70 ms on a Zen 3, ~3 ms a step on average (docs/decisions/030). Objects frozen here that
    later die through their reference counts are freed as before; only a reference cycle among them would outlive
    its last reference."""
    gc.collect()
    gc.freeze()
    # At exit they go back to the collector, which finalises them (extension types count objects never finalised).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def _step_target(config: EngineConfig) -> dict:
    """The scheduler's step-time target and its cost model, learnt from the steps (none without a target)."""
    if config.target_itl_ms is None:
        return {}
    return {"step_cost": OnlineStepCost(), "target_step_s": config.target_itl_ms / 1000}


def _pooling_output(task: str, request: Request, value: list[float] | float | None) -> PoolingRequestOutput:
    """A pooling request's output: its embedding or score (value None: aborted before it was computed)."""
    if task == "embed":
        output = EmbeddingOutput(value) if value is not None else None
        return EmbeddingRequestOutput(request.request_id, output, request.prompt_token_ids, prompt=request.prompt)
    output = ScoringOutput(value) if value is not None else None
    return ScoringRequestOutput(request.request_id, output, request.prompt_token_ids, prompt=request.prompt)


def _make_output(request: Request) -> RequestOutput | None:
    kind = request.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not request.finished:
        return None
    full_text = request.text
    text, token_ids, logprobs = full_text, request.output_token_ids, request.logprobs
    if kind is RequestOutputKind.DELTA:
        text = full_text[request.num_emitted_chars:]
        token_ids = token_ids[request.num_emitted_tokens:]
        logprobs = logprobs[request.num_emitted_tokens:] if logprobs is not None else None
    request.num_emitted_chars = len(full_text)
    request.num_emitted_tokens = request.num_output_tokens
    completion = CompletionOutput(
        index=request.index, text=text, token_ids=list(token_ids), cumulative_logprob=request.cumulative_logprob,
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=request.status.value if request.finished else None, stop_reason=request.stop_reason,
    )
    prompt_logprobs = None
    if request.prompt_logprobs is not None and not (kind is RequestOutputKind.DELTA
                                                    and request.prompt_logprobs_emitted):
        prompt_logprobs, request.prompt_logprobs_emitted = list(request.prompt_logprobs), True
    return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                         prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=request.finished,
                         prompt_logprobs=prompt_logprobs, num_cached_tokens=request.num_cached_tokens or 0)
