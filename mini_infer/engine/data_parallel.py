"""Data parallel: N engine replicas in their own processes (engine/replicas.py, whose supervisor keeps them running)
behind a router with LLMEngine's interface (EngineClient).

create_engine(config) is what LLM, `serve` and `bench` call: one LLMEngine for data_parallel_size 1, else a
DataParallelEngine. That router checks each new request itself (InputProcessor: a bad one fails at once, in the
caller) and sends it to the live replica with the least outstanding work: the prompt tokens still to prefill plus
the tokens still to generate over its unfinished requests, as the replica last reported them, plus what was sent
since. Each replica (which may itself lead tensor/pipeline-parallel ranks) steps on its own and sends back every
step's outputs; the router's step() returns what has arrived, so LLM.generate returns in input order as before.
On the CPU the replicas divide the cores (each pinned to its share when there are enough); on CUDA each takes
its own devices.

A replica that dies (or reports a failure) leaves the router; the others serve on. Each of its unfinished
requests of which step() has returned nothing yet is sent to a live replica again (once: a request whose second
replica dies too is not sent on to a third); any other ends with finish_reason "error", its stop_reason saying why
(AsyncLLMEngine ends that request's stream with RequestFailedError). LLM.generate's requests return nothing before
they finish, so an offline batch completes. The supervisor's thread starts the replica again after a back-off
(1 s, then doubling), at most config.max_replica_restarts times; it loads while the router steps the others and
takes requests once it says it is ready. Requests wait in the router while no replica is live; only when none is
left, nor will be, does the engine stop with WorkerDiedError. shutdown (and interpreter exit) stops every replica,
a starting one included, and a replica exits by itself when the router's process goes away.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import wait


from mini_infer.config import EngineConfig
from mini_infer.engine.client import EngineClient
from mini_infer.engine.detokenizer import load_tokenizer
from mini_infer.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.replicas import (RESTART_BACKOFF_S, ReplicaHealth, ReplicaProcess, ReplicaState, Supervisor,
                                        ended)
from mini_infer.engine.scheduler import SchedulerStats
from mini_infer.errors import InvalidRequestError, WorkerDiedError
from mini_infer.outputs import PoolingRequestOutput, RequestOutput
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams

# A request under which replicas keep dying may be what kills them: after one more try it fails instead of
# taking the next replica down too.
MAX_RESENDS = 1
_RUNNING_TOTALS = ("num_preemptions", "prefix_queries", "prefix_hits", "spec_decode")  # SchedulerStats that grow


def create_engine(config: EngineConfig) -> EngineClient:
    """An LLMEngine, or a DataParallelEngine of config.data_parallel_size replicas."""
    return DataParallelEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)


@dataclass(slots=True)
class _InFlight:
    processed: ProcessedRequest
    returned: bool = False  # step() returned an output of it: sent again, it would repeat what its caller has seen
    resends: int = 0
    aborted: bool = False


class DataParallelEngine(EngineClient):
    def __init__(self, config: EngineConfig, restart_backoff_s: float = RESTART_BACKOFF_S) -> None:
        """restart_backoff_s: the wait before a dead replica's first restart (each next one waits twice as long)."""
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_dir)
        self.processor = InputProcessor(config, self.tokenizer, config.resolved_num_kv_blocks())
        self._supervisor = Supervisor(replace(config, data_parallel_size=1), config.data_parallel_size,
                                       config.max_replica_restarts, restart_backoff_s)
        self.replicas = self._supervisor.replicas
        self._routed: dict[int, ReplicaProcess] = {}  # replica index -> the live process the router sends to and reads
        self._requests: dict[str, _InFlight] = {}  # every unfinished request
        self._owner: dict[str, int] = {}  # request id -> the replica it was sent to (absent while it waits)
        self._waiting: list[str] = []  # requests for which no replica was live
        self._seq = 0
        self._failure: WorkerDiedError | None = None
        self._stats: dict[int, list[dict]] = {}
        self._ready: list[RequestOutput | PoolingRequestOutput] = []  # outputs for the next step() to return
        self._retired = SchedulerStats.idle()  # the running totals of replicas' dead processes
        self._finalizer = weakref.finalize(self, self._supervisor.close)
        try:
            self._supervisor.start()
        except BaseException:
            self.shutdown()
            raise
        self._sync()

    # ---- LLMEngine's interface ----

    def default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None) -> None:
        self._check_usable()
        self._check_id(request_id)
        self.add_processed(request_id, self.processor.process(prompt, params))

    def add_processed(self, request_id: str, processed: ProcessedRequest) -> None:
        """Send a checked request to the live replica with the least outstanding work (it prepares it again there);
        while no replica is live, it waits here for one."""
        self._check_usable()
        self._check_id(request_id)
        self._sync()
        self._requests[request_id] = _InFlight(processed)
        self._dispatch(request_id)

    def _check_id(self, request_id: str) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by an unfinished request",
                                      "request_id")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort unfinished requests; each is reported (finish_reason "abort") in a coming step()."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self._requests.get(rid)
            if request is None:
                continue
            request.aborted = True  # should its replica die before it reports the abort
            if rid in self._owner:
                self._send(self._owner[rid], ("abort", rid))
            else:
                self._waiting.remove(rid)
                del self._requests[rid]
                self._ready.append(ended(rid, request.processed, "abort"))

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs the replicas produced since the last call; waits for some while requests are unfinished."""
        self._check_usable()
        self._sync()
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        self._drain(outputs, block=bool(self._requests))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        """The live replicas' stats summed (KV cache usage: their mean, each cache being of the same size); the
        running totals count dead processes' too, so that they never go down."""
        each = [p.stats for p in self._routed.values()]
        total = {name: sum(getattr(s, name) for s in each) + getattr(self._retired, name)
                 for name in SchedulerStats.__dataclass_fields__}
        return SchedulerStats(**{**total, "kv_cache_usage": total["kv_cache_usage"] / max(1, len(each))})

    def loads(self) -> list[int]:
        """Each replica's outstanding work as the router sees it (tokens to prefill + tokens to generate; 0 while it
        is not live)."""
        return [self._routed[i].load if i in self._routed else 0 for i in range(len(self.replicas))]

    def replica_health(self) -> list[ReplicaHealth]:
        """Every replica's state, restarts and deaths; any thread may ask."""
        return self._supervisor.health()

    def check_health(self) -> None:
        """Raise WorkerDiedError if the engine has stopped or no replica is left, nor will be; changes nothing, so any
        thread may ask."""
        if self._failure is not None:
            raise WorkerDiedError(f"the engine has stopped: {self._failure}")
        health = self._supervisor.health()
        if all(h.state == ReplicaState.GONE.value for h in health):
            raise WorkerDiedError(_none_left(health))

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(f"the engine has stopped: {self._failure}")

    def memory_stats(self) -> list[dict]:
        """Per rank of every live replica (see LLMEngine.memory_stats), each tagged with its replica."""
        self._check_usable()
        self._sync()
        asked = {i: p for i, p in list(self._routed.items()) if self._send(i, ("stats",))}
        outputs: list[RequestOutput | PoolingRequestOutput] = []  # outputs arriving meanwhile wait for step()
        while any(i not in self._stats and self._routed.get(i) is p for i, p in asked.items()):
            self._drain(outputs, block=True)  # (a replica that dies meanwhile answers nothing)
        self._ready = outputs + self._ready
        stats, self._stats = self._stats, {}
        return [{**s, "replica": i} for i in sorted(stats) for s in stats[i]]

    def shutdown(self) -> None:
        if self._failure is None:
            self._failure = WorkerDiedError("the engine was shut down")
        self._finalizer()

    # ---- routing ----

    def _sync(self) -> None:
        """Catch up with the supervisor: settle the requests of replicas that died, route to those that became live,
        send the requests that wait; WorkerDiedError if no replica is left, nor will be."""
        with self._supervisor.lock:
            dead = {i: p for i, p in self._routed.items()
                    if self.replicas[i].current is not p or self.replicas[i].state is not ReplicaState.LIVE}
            for index in dead:
                del self._routed[index]
            for replica in self.replicas:
                if replica.state is ReplicaState.LIVE and replica.index not in self._routed:
                    replica.current.routed = True
                    self._routed[replica.index] = replica.current
            any_left = any(r.state is not ReplicaState.GONE for r in self.replicas)
        for index, process in dead.items():
            self._settle(index, process)
        if not any_left:
            self._fail(_none_left(self._supervisor.health()))
        waiting, self._waiting = self._waiting, []
        for request_id in waiting:
            self._dispatch(request_id)

    def _dispatch(self, request_id: str) -> None:
        """Send the request to the live replica with the least outstanding work, or keep it waiting for one."""
        processed = self._requests[request_id].processed
        while self._routed:
            index = min(sorted(self._routed), key=lambda i: self._routed[i].load)
            self._seq += 1
            prompt = {"prompt": processed.text, "prompt_token_ids": processed.token_ids}
            if self._send(index, ("add", self._seq, request_id, prompt, processed.params)):
                self._routed[index].unreported.append((self._seq, len(processed.token_ids) + processed.max_tokens))
                self._owner[request_id] = index
                return
        self._waiting.append(request_id)

    def _lost(self, index: int, failure: str | None = None) -> None:
        """The routed replica at `index` is gone: the supervisor records it, its requests are settled."""
        process = self._routed.pop(index)
        with self._supervisor.lock:
            self._supervisor.died(self.replicas[index], process, failure)
        self._settle(index, process)

    def _settle(self, index: int, process: ReplicaProcess) -> None:
        """A dead replica's requests, once what it sent before it died is read: each is sent again if nothing of it
        was returned yet (and it was not sent again before), else it ends with finish_reason "error" and why in its
        stop_reason ("abort" if it was aborted; a pooling request ends with no value either way)."""
        self._read(index, process, self._ready)
        process.conn.close()
        self._retired = replace(self._retired, **{name: getattr(self._retired, name) + getattr(process.stats, name)
                                                  for name in _RUNNING_TOTALS})
        why = f"{self.replicas[index].last_exit} while the request ran"
        for request_id in [rid for rid, owner in self._owner.items() if owner == index]:
            del self._owner[request_id]
            request = self._requests[request_id]
            if request.aborted or request.returned or request.resends >= MAX_RESENDS:
                del self._requests[request_id]
                self._ready.append(ended(request_id, request.processed, "abort" if request.aborted else "error",
                                          None if request.aborted else why))
            else:
                request.resends += 1
                self._waiting.append(request_id)

    # ---- talking to the replicas ----

    def _send(self, index: int, message: tuple) -> bool:
        """False if the replica is gone (it has left the router)."""
        try:
            self._routed[index].conn.send(message)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._lost(index)
            return False

    def _drain(self, outputs: list[RequestOutput | PoolingRequestOutput], block: bool) -> None:
        """Collect what the replicas sent (waiting for something first when `block`); a replica whose pipe or process
        ended leaves the router."""
        block = block and not self._ready
        while True:
            conns = {p.conn: i for i, p in self._routed.items()}
            sentinels = {p.process.sentinel: i for i, p in self._routed.items()}
            ready = wait([*conns, *sentinels, self._supervisor.router_wake], timeout=None if block else 0)
            if not ready:
                break
            gone: dict[int, str | None] = {}
            for handle in ready:  # messages first: a failing replica says why before it exits
                if handle in conns:
                    failure = self._read(conns[handle], self._routed[conns[handle]], outputs)
                    if failure is not None:
                        gone[conns[handle]] = failure or None
            for handle in ready:
                if handle in sentinels:
                    gone.setdefault(sentinels[handle], None)
            for index, failure in gone.items():
                self._lost(index, failure)
            while self._supervisor.router_wake.poll():
                self._supervisor.router_wake.recv()
            self._sync()
            block = False
        outputs.extend(self._ready)
        self._ready = []

    def _read(self, index: int, process: ReplicaProcess, outputs: list) -> str | None:
        """Take every message waiting in the replica's pipe; None while it serves, else why it is gone: its failure, or
        "" when its pipe ended."""
        while True:
            try:
                if not process.conn.poll():
                    return None
                kind, payload = process.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                return ""
            if kind == "outputs":
                step_outputs, process.stats, process.reported_load, process.reported_seq = payload
                process.unreported = [(s, w) for s, w in process.unreported if s > process.reported_seq]
                for output in step_outputs:
                    self._returned(output)
                outputs.extend(step_outputs)
            elif kind == "stats":
                self._stats[index] = payload
            else:
                return f"failed: {payload}"

    def _returned(self, output: RequestOutput | PoolingRequestOutput) -> None:
        request = self._requests.get(output.request_id)
        if request is not None and output.finished:
            del self._requests[output.request_id]
            self._owner.pop(output.request_id, None)
        elif request is not None:
            request.returned = True

    def _fail(self, reason: str):
        self._failure = WorkerDiedError(f"{reason}; every replica has been stopped")
        self._finalizer()
        raise self._failure


def _none_left(health: list[ReplicaHealth]) -> str:
    return "no data-parallel replica is left: " + "; ".join(h.detail for h in health)
