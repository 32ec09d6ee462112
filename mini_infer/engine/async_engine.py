"""AsyncLLMEngine: one LLMEngine stepped by a background thread, with asyncio callers.

The thread owns the engine: requests are added and aborted through a command queue it drains between steps,
so no caller ever waits on a forward pass, and every step's outputs go to the callers' asyncio queues. A
caller that stops reading (a client that disconnects) aborts its request; its KV blocks return at the next
step boundary. If a step raises, the engine is dead: every open request fails with EngineDeadError and new
ones are refused; shutdown() fails them with its subclass EngineShutdownError. A request the engine ends with
finish_reason "error" (a data-parallel replica died under it after some of its output was out) fails alone, with
RequestFailedError; the engine serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from mini_infer.config import EngineConfig
from mini_infer.engine.data_parallel import DataParallelEngine
from mini_infer.engine.replicas import ReplicaHealth
from mini_infer.engine.input_processor import ProcessedRequest, PromptType
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.metrics import EngineMetrics
from mini_infer.outputs import PoolingRequestOutput, RequestOutput
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an exception; nothing more can run on this engine."""


class EngineShutdownError(EngineDeadError):
    """The engine was shut down (the server is stopping) while the request was open, or before it came."""


class RequestFailedError(RuntimeError):
    """This request alone failed on the engine's side, after some of its output was delivered (its data-parallel
    replica died): nothing of it can be taken back, so it is not run again; the engine serves on."""


@dataclass(slots=True)
class _Stream:
    """Where the engine thread delivers one request's outputs (or the exception that ends it)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | PoolingRequestOutput | BaseException) -> None:
        self.call(self.queue.put_nowait, item)

    def call(self, callback, *args) -> None:
        """Run `callback(*args)` on the caller's event loop, unless that loop has closed (nobody is left to
        tell, and raising here would kill the engine thread)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)


class AsyncLLMEngine:
    """What a server needs of an engine it does not own: requests as async streams, and read-only facts taken
    when it was built (config, tokenizer, default sampling parameters, metrics), never the live engine."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine  # owned by the engine thread from here on
        self._metrics = metrics
        self._config = engine.config
        self._tokenizer = engine.tokenizer
        self._default_params = engine.default_sampling_params()
        self._processor = engine.processor  # process() reads the tokenizer and the config; its grammar cache locks
        if metrics is not None and isinstance(engine, DataParallelEngine):
            metrics.watch_replicas(engine.replica_health)
        self.error: BaseException | None = None
        self._ended: EngineDeadError | None = None  # set by the engine thread before it fails what is left
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._thread = threading.Thread(target=self._run, name="mini-infer-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop ----

    @property
    def config(self) -> EngineConfig:
        """The engine's validated configuration (model directory, max_model_len, ...)."""
        return self._config

    @property
    def tokenizer(self):
        """The model's tokenizer (None for a directory without tokenizer.json): chat templates, token counts."""
        return self._tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """The sampling defaults of the model's generation_config.json (a copy: callers may change it)."""
        return replace(self._default_params)

    @property
    def metrics_registry(self):
        """The Prometheus registry of the engine's metrics (None when built without metrics)."""
        return self._metrics.registry if self._metrics is not None else None

    @property
    def healthy(self) -> bool:
        """The engine thread runs and the engine's processes are alive (worker ranks; for data parallel: some replica
        is left, live or to be restarted)."""
        return self.problem() is None

    def problem(self) -> str | None:
        """Why the engine cannot serve (see healthy), or None."""
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        if not self._thread.is_alive():
            return "the engine has been shut down"
        try:
            self.engine.check_health()
        except RuntimeError as e:
            return str(e)
        return None

    def replicas(self) -> list[ReplicaHealth] | None:
        """Each data-parallel replica's state, restarts and deaths (None for a single engine); any thread may ask."""
        return self.engine.replica_health() if isinstance(self.engine, DataParallelEngine) else None

    def generate(self, request_id: str, prompt: PromptType,
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs (DELTA: what is new each step) until it finishes.

        Raises the engine's InvalidRequestError if the request is refused, EngineDeadError if the engine fails,
        RequestFailedError if this request alone fails.
        Leaving early (break, cancellation, aclose) aborts the request."""
        return self._stream(request_id, prompt, replace(params, output_kind=RequestOutputKind.DELTA))

    def encode(self, request_id: str, prompt: PromptType,
               params: PoolingParams | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's request (task embed or score): yields its one output, its embedding or score, once its
        prompt is computed; refusals, engine failure and leaving early as generate()."""
        return self._stream(request_id, prompt, params if params is not None else PoolingParams())

    async def _stream(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams):
        self._check_alive()
        loop = asyncio.get_running_loop()
        # Checked, tokenized and its grammar compiled here, on a worker thread (a refusal raises here): a long text or
        # a new grammar would otherwise hold every stream up on the engine's thread.
        processed = await loop.run_in_executor(None, self._processor.process, prompt, params)
        stream = _Stream(loop, asyncio.Queue())
        added = loop.create_future()
        self._commands.put(("add", request_id, processed, stream, added))
        if self._ended is not None:  # the thread may have drained its queue before this command came
            _settle(added, self._ended)
        elif not self.healthy:  # died before it could take the command
            _settle(added, EngineDeadError(f"the engine has stopped: {self.error!r}"))
        finished = False
        try:
            await added
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            refused = added.done() and not added.cancelled() and added.exception() is not None
            if not finished and not refused:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, failing every open or pending request with EngineShutdownError (so no caller
        waits forever), then stop the engine's worker processes."""
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if isinstance(self._ended, EngineShutdownError):
            raise EngineShutdownError("the engine has been shut down")
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}" if self.error else
                                  "the engine has been shut down")

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                self._report_state()
        except BaseException as e:  # noqa: BLE001 - the engine is dead whatever it was; callers get told
            logger.exception("engine step failed; the engine is stopped")
            self.error = e
            self._fail_everything(EngineDeadError(f"the engine failed: {e!r}"))
        else:
            self._fail_everything(EngineShutdownError("the engine has been shut down"))

    def _fail_everything(self, error: EngineDeadError) -> None:
        """End every open stream and every add still queued with `error`."""
        self._ended = error
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        self._fail_pending_commands(error)

    def _take_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])

    def _add(self, request_id: str, processed: ProcessedRequest, stream: _Stream, added: asyncio.Future) -> None:
        try:
            self.engine.add_processed(request_id, processed)
        except Exception as e:  # noqa: BLE001 - refused (ValueError) or failed: this request alone, the engine serves on
            if not isinstance(e, ValueError):
                logger.exception("adding request %r failed; the engine serves on", request_id)
            stream.loop.call_soon_threadsafe(_settle, added, e)
            return
        self._streams[request_id] = stream
        if self._metrics is not None:
            self._metrics.on_add(request_id, time.monotonic())
        stream.loop.call_soon_threadsafe(_settle, added, None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished (or refused) already
        self.engine.abort_request(request_id)
        if self._metrics is not None:
            self._metrics.on_abort(request_id)

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        if self._metrics is not None:
            self._metrics.on_outputs(outputs, time.monotonic())
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted: its reader is gone
            if output.finished:
                del self._streams[output.request_id]
            failure = _failure_of(output)
            stream.put(output if failure is None else RequestFailedError(failure))

    def _report_state(self) -> None:
        if self._metrics is not None:
            self._metrics.on_state(self.engine.stats())

    def _fail_pending_commands(self, error: EngineDeadError) -> None:
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                return
            if command[0] == "add":
                stream, added = command[3], command[4]  # ("add", request_id, processed, stream, added)
                stream.call(_settle, added, error)


def _failure_of(output: RequestOutput | PoolingRequestOutput) -> str | None:
    """Why the engine ended the request with finish_reason "error" (its stop_reason), or None."""
    if isinstance(output, RequestOutput) and output.finished:
        for completion in output.outputs:
            if completion.finish_reason == "error":
                return str(completion.stop_reason)
    return None


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
