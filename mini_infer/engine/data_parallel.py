"""Data parallel: N engine replicas in their own processes behind a router with LLMEngine's interface (EngineClient).

create_engine(config) is what LLM, `serve` and `bench` call: one LLMEngine for data_parallel_size 1, else a
DataParallelEngine. That router checks each new request itself (InputProcessor: a bad one fails at once, in the
caller) and sends it to the replica with the least outstanding work: the prompt tokens still to prefill plus the
tokens still to generate over its unfinished requests, as the replica last reported them, plus what was sent
since. Each replica (which may itself lead tensor/pipeline-parallel ranks) steps on its own and sends back every
step's outputs; the router's step() returns what has arrived, so LLM.generate returns in input order as before.
On the CPU the replicas divide the cores (each pinned to its share when there are enough); on CUDA each takes
its own devices. A replica that dies or fails stops the whole engine with WorkerDiedError; shutdown (and
interpreter exit) stops every replica, and a replica exits by itself when the router's process goes away.
"""

from __future__ import annotations

import os
import signal
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mini_infer.config import EngineConfig
from mini_infer.executor.ranks import STOP_GRACE_S, cpu_share
from mini_infer.engine.client import EngineClient
from mini_infer.engine.detokenizer import load_tokenizer
from mini_infer.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.scheduler import SchedulerStats
from mini_infer.errors import InvalidRequestError, WorkerDiedError
from mini_infer.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams


def create_engine(config: EngineConfig) -> EngineClient:
    """An LLMEngine, or a DataParallelEngine of config.data_parallel_size replicas."""
    return DataParallelEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)


@dataclass(slots=True)
class _Replica:
    process: mp.Process
    conn: Connection
    reported_load: int = 0  # outstanding tokens at the replica's last report
    reported_seq: int = -1  # the last add that report included
    unreported: list[tuple[int, int]] = field(default_factory=list)  # (seq, work) of adds sent since
    stats: SchedulerStats = field(default_factory=SchedulerStats.idle)  # at its last report

    @property
    def load(self) -> int:
        return self.reported_load + sum(work for _, work in self.unreported)


class DataParallelEngine(EngineClient):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(Path(config.model))
        self.processor = InputProcessor(config, self.tokenizer, config.resolved_num_kv_blocks())
        self.replicas: list[_Replica] = []
        self._owner: dict[str, int] = {}  # unfinished request id -> replica index
        self._seq = 0
        self._failure: WorkerDiedError | None = None
        self._stats: dict[int, list[dict]] = {}
        self._early: list[RequestOutput] = []  # outputs that arrived while memory_stats() waited
        self._finalizer = weakref.finalize(self, _stop, self.replicas)
        try:
            self._start_replicas()
        except BaseException:
            self.shutdown()
            raise

    def _start_replicas(self) -> None:
        dp = self.config.data_parallel_size
        replica_config = replace(self.config, data_parallel_size=1)
        context = mp.get_context("spawn")
        for index in range(dp):
            ours, theirs = context.Pipe()
            # Not daemonic: a replica with tensor/pipeline parallelism starts worker processes of its own.
            process = context.Process(target=_replica_main, name=f"mini-infer-dp{index}",
                                      args=(replica_config, index, dp, theirs))
            process.start()
            theirs.close()
            self.replicas.append(_Replica(process, ours))
        for index, replica in enumerate(self.replicas):  # each loads its model; any failure stops them all
            kind, payload = self._receive_one(index)
            if kind != "ready":
                raise WorkerDiedError(f"data-parallel replica {index} failed to start: {payload}")

    # ---- LLMEngine's interface ----

    def default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None) -> None:
        self._check_replicas()
        self._check_id(request_id)
        self.add_processed(request_id, self.processor.process(prompt, params))

    def add_processed(self, request_id: str, processed: ProcessedRequest) -> None:
        """Send a checked request to the replica with the least outstanding work (it prepares it again there)."""
        self._check_replicas()
        self._check_id(request_id)
        index = min(range(len(self.replicas)), key=lambda i: self.replicas[i].load)
        replica = self.replicas[index]
        self._seq += 1
        self._send(index, ("add", self._seq, request_id, {"prompt": processed.text,
                                                           "prompt_token_ids": processed.token_ids}, processed.params))
        replica.unreported.append((self._seq, len(processed.token_ids) + processed.max_tokens))
        self._owner[request_id] = index

    def _check_id(self, request_id: str) -> None:
        if request_id in self._owner:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by an unfinished request",
                                      "request_id")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Ask the owning replicas to abort; each reports its aborts (finish_reason "abort") in a coming step()."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            index = self._owner.get(rid)
            if index is not None:
                self._send(index, ("abort", rid))

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas produced since the last call; waits for some while requests are unfinished."""
        self._check_replicas()
        outputs: list[RequestOutput] = []
        self._drain(outputs, block=bool(self._owner))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    def stats(self) -> SchedulerStats:
        """The replicas' stats summed (KV cache usage: their mean, each cache being of the same size)."""
        each = [r.stats for r in self.replicas]
        total = {name: sum(getattr(s, name) for s in each) for name in SchedulerStats.__dataclass_fields__}
        return SchedulerStats(**{**total, "kv_cache_usage": total["kv_cache_usage"] / len(each)})

    def loads(self) -> list[int]:
        """Each replica's outstanding work as the router sees it (tokens to prefill + tokens to generate)."""
        return [r.load for r in self.replicas]

    def check_health(self) -> None:
        """Raise WorkerDiedError if the engine has failed or a replica has exited; changes nothing, so any thread
        may ask (the thread that steps the engine stops the other replicas when it next steps)."""
        if self._failure is not None:
            raise WorkerDiedError(f"the engine has stopped: {self._failure}")
        dead = self._dead_replica()
        if dead is not None:
            raise WorkerDiedError(f"{dead}; the engine cannot serve")

    def _dead_replica(self) -> str | None:
        for index, replica in enumerate(self.replicas):
            if replica.process.exitcode is not None:
                return (f"data-parallel replica {index} (pid {replica.process.pid}) exited with code "
                        f"{replica.process.exitcode}")
        return None

    def _check_replicas(self) -> None:
        """check_health, stopping the other replicas first if one is gone."""
        dead = self._dead_replica() if self._failure is None else None
        if dead is not None:
            self._fail(dead)
        self.check_health()

    def memory_stats(self) -> list[dict]:
        """Per rank of every replica (see LLMEngine.memory_stats), each tagged with its replica."""
        self._check_replicas()
        for index in range(len(self.replicas)):
            self._send(index, ("stats",))
        outputs: list[RequestOutput] = []  # outputs arriving meanwhile are not lost: they wait for step()
        while len(self._stats) < len(self.replicas):
            self._drain(outputs, block=True)
        self._early = outputs
        stats, self._stats = self._stats, {}
        return [{**s, "replica": i} for i in sorted(stats) for s in stats[i]]

    def shutdown(self) -> None:
        if self._failure is None:
            self._failure = WorkerDiedError("the engine was shut down")
        self._finalizer()

    # ---- talking to the replicas ----

    def _send(self, index: int, message: tuple) -> None:
        try:
            self.replicas[index].conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._check_replicas()
            self._fail(f"data-parallel replica {index} stopped taking requests")

    def _drain(self, outputs: list[RequestOutput], block: bool) -> None:
        """Collect what the replicas sent (waiting for something first when `block`)."""
        outputs.extend(self._early)
        self._early = []
        block = block and not outputs
        conns = {r.conn: i for i, r in enumerate(self.replicas)}
        sentinels = {r.process.sentinel: i for i, r in enumerate(self.replicas)}
        while True:
            ready = wait([*conns, *sentinels], timeout=None if block else 0)
            if not ready:
                return
            for handle in ready:  # messages first: a failing replica says why before it exits
                if handle in conns:
                    self._handle(conns[handle], outputs)
            for handle in ready:  # a sentinel fires a moment before its process can be reaped
                if handle in sentinels:
                    self.replicas[sentinels[handle]].process.join(5.0)
            self._check_replicas()
            block = False

    def _handle(self, index: int, outputs: list[RequestOutput]) -> None:
        replica = self.replicas[index]
        while replica.conn.poll():
            kind, payload = self._receive_one(index)
            if kind == "outputs":
                step_outputs, replica.stats, replica.reported_load, replica.reported_seq = payload
                replica.unreported = [(s, w) for s, w in replica.unreported if s > replica.reported_seq]
                for output in step_outputs:
                    if output.finished:
                        self._owner.pop(output.request_id, None)
                outputs.extend(step_outputs)
            elif kind == "stats":
                self._stats[index] = payload
            else:
                self._fail(f"data-parallel replica {index} failed: {payload}")

    def _receive_one(self, index: int) -> tuple:
        replica = self.replicas[index]
        try:
            return replica.conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            replica.process.join(5.0)
            self._fail(f"data-parallel replica {index} (pid {replica.process.pid}) exited with code "
                       f"{replica.process.exitcode}")

    def _fail(self, reason: str):
        self._failure = WorkerDiedError(f"{reason}; every replica has been stopped")
        self._finalizer()
        raise self._failure


def _stop(replicas: list[_Replica]) -> None:
    """Ask every replica to stop, then make sure: no process outlives the engine."""
    for replica in replicas:
        try:
            replica.conn.send(("stop",))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass
    for replica in replicas:
        replica.process.join(STOP_GRACE_S)
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(STOP_GRACE_S)
        replica.conn.close()


def _replica_main(config: EngineConfig, index: int, count: int, conn: Connection) -> None:
    """One replica: an LLMEngine stepped whenever it has work, fed and drained through `conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the router stops us
    try:
        _take_devices(config, index, count)
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - reported to the router, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", None))
    last_seq, aborted, refused = -1, False, []
    try:
        while True:
            idle = not engine.has_unfinished_requests() and not aborted
            while conn.poll(None if idle else 0):
                message = conn.recv()
                idle = False
                if message[0] == "add":
                    _, last_seq, request_id, prompt, params = message
                    refused += _add_or_refuse(engine, request_id, prompt, params)
                elif message[0] == "abort":
                    engine.abort_request(message[1])
                    aborted = True
                elif message[0] == "stats":
                    conn.send(("stats", engine.memory_stats()))
                else:
                    engine.shutdown()
                    return
            if engine.has_unfinished_requests() or aborted or refused:
                outputs, refused = refused + engine.step(), []
                aborted = False
                conn.send(("outputs", (outputs, engine.stats(), _outstanding(engine), last_seq)))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the router's process is gone
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - reported to the router, which raises it
        engine.shutdown()
        try:
            conn.send(("error", str(e) if isinstance(e, WorkerDiedError) else f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)


def _add_or_refuse(engine: LLMEngine, request_id: str, prompt: dict,
                   params: SamplingParams | PoolingParams) -> list[RequestOutput | PoolingRequestOutput]:
    """Add the request; if this replica refuses it (the router checks everything first, so it should not), that
    request alone ends, aborted (a pooling request: with no value), and the replica serves on."""
    try:
        engine.add_request(request_id, prompt, params)
    except ValueError as e:
        print(f"mini-infer replica: refused request {request_id!r}: {e}", file=sys.stderr)
        if isinstance(params, PoolingParams):
            return [PoolingRequestOutput(request_id, None, list(prompt.get("prompt_token_ids", [])),
                                         prompt=prompt.get("prompt"))]
        refused = CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")
        return [RequestOutput(request_id, prompt.get("prompt"), list(prompt.get("prompt_token_ids", [])),
                              [refused], finished=True)]
    return []


def _outstanding(engine: LLMEngine) -> int:
    """Prompt tokens still to prefill plus tokens still to generate, over the replica's unfinished requests."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) + r.max_tokens - r.num_output_tokens
               for r in engine.requests.values())


def _take_devices(config: EngineConfig, index: int, count: int) -> None:
    """Replica `index` of `count`: its share of the cores (pinned when there are enough), or its CUDA devices."""
    if torch.device(config.device).type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        mine = devices[index * config.world_size: (index + 1) * config.world_size]
        if len(mine) < config.world_size:
            raise ValueError(f"data_parallel_size={count} x {config.world_size} ranks needs "
                             f"{count * config.world_size} CUDA devices; {len(devices)} are visible")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)  # before this process initialises CUDA
        return
    cpus = cpu_share(index, count)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if config.world_size == 1:  # a tensor/pipeline-parallel replica divides its cores among its own ranks
        cores = len(cpus) if cpus is not None else max(1, len(os.sched_getaffinity(0)) // count)
        torch.set_num_threads(cores)
