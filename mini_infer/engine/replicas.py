"""The processes of data-parallel replicas: each an LLMEngine stepped in a process of its own (replica_main), and the
Supervisor that starts them, watches them from a thread, starts a dead one again after a back-off up to a bound, and
stops them all. The router over them is engine/data_parallel.py.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from mini_infer.config import EngineConfig
from mini_infer.distributed.processes import new_process, process_context
from mini_infer.engine.input_processor import ProcessedRequest
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.scheduler import SchedulerStats
from mini_infer.errors import WorkerDiedError
from mini_infer.executor.ranks import STOP_GRACE_S, cpu_share
from mini_infer.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import SamplingParams

RESTART_BACKOFF_S = 1.0  # before a replica's first restart; each next one waits twice as long


class ReplicaState(str, enum.Enum):
    STARTING = "starting"  # its process loads the model
    LIVE = "live"  # it takes requests
    BACKOFF = "backoff"  # dead; started again at its restart_at
    GONE = "gone"  # dead, its restarts spent


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """One replica as /health and the metrics report it."""

    replica: int
    state: str  # a ReplicaState's value
    pid: int | None
    deaths: int
    restarts: int
    detail: str  # what it does now, and after a death: why it died and what follows


@dataclass(slots=True, eq=False)
class ReplicaProcess:
    """One process of a replica, and its outstanding work as the router sees it."""

    process: BaseProcess
    conn: Connection
    routed: bool = False  # the router reads (and closes) its pipe from now on; until then the supervisor does
    reported_load: int = 0  # outstanding tokens at the replica's last report
    reported_seq: int = -1  # the last add that report included
    unreported: list[tuple[int, int]] = field(default_factory=list)  # (seq, work) of adds sent since
    stats: SchedulerStats = field(default_factory=SchedulerStats.idle)  # at its last report

    @property
    def load(self) -> int:
        return self.reported_load + sum(work for _, work in self.unreported)


@dataclass(slots=True, eq=False)
class Replica:
    """A replica's place: its process of the moment and its history (changed under the supervisor's lock)."""

    index: int
    current: ReplicaProcess | None = None
    state: ReplicaState = ReplicaState.STARTING
    deaths: int = 0
    restarts: int = 0
    last_exit: str | None = None  # why its last process ended
    restart_at: float | None = None  # (time.monotonic) while in BACKOFF

    @property
    def process(self) -> BaseProcess | None:
        return self.current.process if self.current is not None else None


class Supervisor:
    """The replicas' processes over the engine's life: started together and each awaited at first; then watched by a
    thread (so a death is seen while the router idles too), each dead one started again after its back-off until
    the bound, a starting one's "ready" read there; all stopped by close(). That thread and the router change a
    replica's state under `lock`."""

    def __init__(self, config: EngineConfig, count: int, max_restarts: int, backoff_s: float) -> None:
        self.config, self.count, self.max_restarts, self.backoff_s = config, count, max_restarts, backoff_s
        self.lock = threading.Lock()
        self.replicas = [Replica(index) for index in range(count)]
        self.closed = False
        self._context = process_context()
        self._wake, self._waker = self._context.Pipe(duplex=False)  # to the thread: look again
        self.router_wake, self._router_waker = self._context.Pipe(duplex=False)  # to the router: a replica changed
        self._thread = threading.Thread(target=self._run, name="mini-infer-dp-supervisor", daemon=True)

    def start(self) -> None:
        """Start every replica and wait for each to load (WorkerDiedError if one fails), then watch them."""
        with self.lock:
            for replica in self.replicas:
                replica.current = self._spawn(replica.index)
        for replica in self.replicas:
            try:
                kind, payload = replica.current.conn.recv()
            except (EOFError, OSError):
                replica.process.join(STOP_GRACE_S)
                kind, payload = "exited", f"pid {replica.process.pid} {exit_description(replica.process)}"
            if kind != "ready":
                raise WorkerDiedError(f"data-parallel replica {replica.index} failed to start: {payload}")
            replica.state = ReplicaState.LIVE
        self._thread.start()

    def health(self) -> list[ReplicaHealth]:
        """Every replica's state (from any thread)."""
        with self.lock:
            return [ReplicaHealth(r.index, r.state.value, r.process.pid if r.process else None, r.deaths, r.restarts,
                                  self._detail(r)) for r in self.replicas]

    def _detail(self, replica: Replica) -> str:
        last, state = replica.last_exit, replica.state
        if state is ReplicaState.LIVE:
            return "taking requests" + (f" (restarted after: {last})" if last else "")
        if state is ReplicaState.STARTING:
            return f"{last}; restart {replica.restarts} of {self.max_restarts} loading" if last else "loading"
        if state is ReplicaState.BACKOFF:
            wait_s = max(0.0, replica.restart_at - time.monotonic())
            return f"{last}; restart {replica.restarts + 1} of {self.max_restarts} in {wait_s:.1f} s"
        return f"{last}; not restarted: {replica.restarts} restarts already (the bound)"

    def died(self, replica: Replica, process: ReplicaProcess, failure: str | None = None) -> None:
        """`process` of `replica` is gone (it reported `failure`, or its pipe or process ended): it is reaped (stopped
        first if it still runs), and the replica starts again after its back-off, or is given up at the bound. A
        no-op for a death already recorded. Call with `lock` held."""
        if replica.current is not process or replica.state not in (ReplicaState.LIVE, ReplicaState.STARTING):
            return
        process.process.join(STOP_GRACE_S)
        if process.process.is_alive():
            process.process.kill()
            process.process.join(STOP_GRACE_S)
        replica.deaths += 1
        replica.last_exit = (f"replica {replica.index} (pid {process.process.pid}) "
                             f"{failure or exit_description(process.process)}")
        if not process.routed:
            process.conn.close()
        self._schedule_restart(replica)
        self._waker.send(None)
        self._router_waker.send(None)

    def close(self) -> None:
        """Stop the thread, then every replica (a starting one too): no process outlives the engine."""
        with self.lock:
            self.closed = True
            self._waker.send(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * STOP_GRACE_S)
        stop_processes([r.current for r in self.replicas if r.current is not None])
        for conn in (self._wake, self._waker, self.router_wake, self._router_waker):
            conn.close()

    # ---- the thread ----

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.closed:
                    return
                watched = self._watched()
                restart_at = [r.restart_at for r in self.replicas if r.state is ReplicaState.BACKOFF]
                timeout = max(0.0, min(restart_at) - time.monotonic()) if restart_at else None
            ready = wait(list(watched), timeout)
            with self.lock:
                if self.closed:
                    return
                while self._wake.poll():
                    self._wake.recv()
                for handle in sorted(ready, key=lambda h: isinstance(h, int)):  # a pipe's "error" before the exit
                    if watched.get(handle) is not None:
                        self._on_event(handle, *watched[handle])
                self._restart_due()

    def _watched(self) -> dict:
        """What the thread waits on: the wake-up pipe, every live or starting process's exit, a starting one's pipe."""
        watched: dict = {self._wake: None}
        for replica in self.replicas:
            if replica.state in (ReplicaState.LIVE, ReplicaState.STARTING):
                watched[replica.process.sentinel] = (replica, replica.current)
                if replica.state is ReplicaState.STARTING:
                    watched[replica.current.conn] = (replica, replica.current)
        return watched

    def _on_event(self, handle, replica: Replica, process: ReplicaProcess) -> None:
        if handle is not process.conn:
            self.died(replica, process)
            return
        if replica.current is not process or replica.state is not ReplicaState.STARTING:
            return
        try:
            kind, payload = process.conn.recv()
        except (EOFError, OSError):
            self.died(replica, process)
            return
        if kind == "ready":
            replica.state = ReplicaState.LIVE
            self._router_waker.send(None)
        else:
            self.died(replica, process, f"failed to start: {payload}")

    def _schedule_restart(self, replica: Replica) -> None:
        if replica.restarts < self.max_restarts:
            replica.state = ReplicaState.BACKOFF
            replica.restart_at = time.monotonic() + self.backoff_s * 2 ** replica.restarts
        else:
            replica.state, replica.restart_at = ReplicaState.GONE, None

    def _restart_due(self) -> None:
        now = time.monotonic()
        for replica in self.replicas:
            if replica.state is ReplicaState.BACKOFF and replica.restart_at <= now:
                replica.restarts += 1
                try:
                    replica.current = self._spawn(replica.index)
                    replica.state = ReplicaState.STARTING
                except OSError as e:
                    replica.last_exit = f"replica {replica.index} could not be started again: {e}"
                    self._schedule_restart(replica)

    def _spawn(self, index: int) -> ReplicaProcess:
        ours, theirs = self._context.Pipe()
        # Not daemonic: a replica with tensor/pipeline parallelism starts worker processes of its own.
        process = new_process(self._context, replica_main, (self.config, index, self.count, theirs),
                              name=f"mini-infer:dp{index}")
        process.start()
        theirs.close()
        return ReplicaProcess(process, ours)


def ended(request_id: str, processed: ProcessedRequest, finish_reason: str,
           why: str | None = None) -> RequestOutput | PoolingRequestOutput:
    """The last output of a request that ends without running (a pooling one's: with no value)."""
    if isinstance(processed.params, PoolingParams):
        return PoolingRequestOutput(request_id, None, list(processed.token_ids), prompt=processed.text)
    completion = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason, stop_reason=why)
    return RequestOutput(request_id, processed.text, list(processed.token_ids), [completion], finished=True)


def exit_description(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:  # reaped by another thread of this process: the code went there
        return "exited"
    if code < 0:
        try:
            return f"exited with signal {signal.Signals(-code).name}"
        except ValueError:
            return f"exited with signal {-code}"
    return f"exited with code {code}"


def stop_processes(processes: list[ReplicaProcess]) -> None:
    """Ask every replica to stop, then make sure: no process outlives the engine."""
    for process in processes:
        try:
            process.conn.send(("stop",))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass
    for process in processes:
        process.process.join(STOP_GRACE_S)
        if process.process.is_alive():
            process.process.kill()
            process.process.join(STOP_GRACE_S)
        process.conn.close()


def replica_main(config: EngineConfig, index: int, count: int, conn: Connection) -> None:
    """One replica: an LLMEngine stepped whenever it has work, fed and drained through `conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the router stops us
    try:
        take_devices(config, index, count)
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
                    refused += add_or_refuse(engine, request_id, prompt, params)
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
                conn.send(("outputs", (outputs, engine.stats(), outstanding(engine), last_seq)))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the router's process is gone
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - reported to the router, which raises it
        engine.shutdown()
        try:
            conn.send(("error", str(e) if isinstance(e, WorkerDiedError) else f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)


def add_or_refuse(engine: LLMEngine, request_id: str, prompt: dict,
                   params: SamplingParams | PoolingParams) -> list[RequestOutput | PoolingRequestOutput]:
    """Add the request; if this replica refuses it (the router checks everything first, so it should not), that
    request alone ends, aborted (a pooling request: with no value), and the replica serves on."""
    try:
        engine.add_request(request_id, prompt, params)
    except ValueError as e:
        print(f"mini-infer replica: refused request {request_id!r}: {e}", file=sys.stderr)
        token_ids = list(prompt.get("prompt_token_ids", []))
        return [ended(request_id, ProcessedRequest(prompt.get("prompt"), token_ids, params, 0), "abort")]
    return []


def outstanding(engine: LLMEngine) -> int:
    """Prompt tokens still to prefill plus tokens still to generate, over the replica's unfinished requests."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) + r.max_tokens - r.num_output_tokens
               for r in engine.requests.values())


def take_devices(config: EngineConfig, index: int, count: int) -> None:
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
