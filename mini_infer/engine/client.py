"""EngineClient: what every caller of an engine uses (LLM.generate, the CLI, the server, the benchmarks), implemented
by one replica (LLMEngine) and by the data-parallel router over replicas (DataParallelEngine)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

from mini_infer.engine.input_processor import ProcessedRequest, PromptType
from mini_infer.engine.scheduler import SchedulerStats
from mini_infer.outputs import PoolingRequestOutput, RequestOutput
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams


class EngineClient(ABC):
    @abstractmethod
    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None) -> None:
        """Queue a request (a ValueError naming the field refuses a bad one, leaving the rest served); PoolingParams
        for a pooling model's (task embed or score)."""

    @abstractmethod
    def add_processed(self, request_id: str, processed: ProcessedRequest) -> None:
        """Queue a request its caller already prepared (InputProcessor.process, on another thread, say)."""

    @abstractmethod
    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort unfinished requests; each is reported once with finish_reason "abort"."""

    @abstractmethod
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Advance the engine; the outputs of the requests that moved."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    @abstractmethod
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM does."""

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """The scheduler's queues, KV cache use, preemptions and prefix-cache lookups (summed over replicas)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise WorkerDiedError if the engine cannot step again."""

    @abstractmethod
    def memory_stats(self) -> list[dict]:
        """Per rank: parameter, KV and peak memory bytes and the kernels it runs."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every process the engine started; it cannot step afterwards."""

    def kv_cache_usage(self) -> float:
        return self.stats().kv_cache_usage

    def run_until_done(self) -> Iterator[RequestOutput | PoolingRequestOutput]:
        """Step until no request is unfinished, yielding every step's outputs as they come: the one step loop of
        every caller (LLM.generate, the CLI, the benchmarks)."""
        while self.has_unfinished_requests():
            yield from self.step()
