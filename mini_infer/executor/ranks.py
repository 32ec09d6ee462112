"""The ranks of one tensor/pipeline-parallel engine, from rank 0's side, and the loop the other ranks run.

Rank 0 is the engine process: it schedules, broadcasts each step's StepPlan over the control group, runs its
own shard and samples. Launched locally, it starts ranks 1..N-1 itself (from multiprocessing's fork server:
distributed/processes.py), one per device; on the CPU the ranks divide the cores between them (each pinned to its
share when there are enough).
Launched torchrun-style (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK set), every rank is started by the user on
its machine: rank 0 runs an engine command, the others `mini-infer worker` with the same engine flags.

Failure: a rank that dies closes its connections, so the next collective on rank 0 fails at once; rank 0 then
names the dead worker, stops the others and raises WorkerDiedError. Workers ignore Ctrl-C (rank 0 stops them)
and exit when rank 0 goes away.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from mini_infer.config import EngineConfig
from mini_infer.distributed.comm import Comm, init_process_groups
from mini_infer.distributed.processes import new_process, process_context
from mini_infer.errors import WorkerDiedError

# How long a collective may wait for a rank that is alive but silent (a dead one fails at once).
TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class Launch:
    """How this process joins its world."""

    rank: int
    world_size: int
    init_method: str
    device: torch.device
    cpus: list[int] | None  # cores to pin this rank to (None: leave the affinity alone)
    threads: int | None  # torch threads for this rank (None: leave torch's choice)


def env_launch(config: EngineConfig) -> Launch | None:
    """The torchrun-style launch the environment describes, or None when it describes none."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"torchrun-style launch: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must all be set "
                         f"(and LOCAL_RANK, LOCAL_WORLD_SIZE be integers when set): {e}") from None
    return Launch(rank, world, f"tcp://{address}:{port}", rank_device(config.device, local_rank), None,
                  _cpu_threads(local_world))


def rank_device(device: str, local_rank: int) -> torch.device:
    base = torch.device(device)
    return torch.device("cuda", local_rank) if base.type == "cuda" else base


def cpu_share(index: int, count: int) -> list[int] | None:
    """Share `index` of `count` equal shares of this process's cores, or None when there are fewer cores than
    shares (they then float)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    size = len(cores) // count
    return cores[index * size: (index + 1) * size]


def _cpu_threads(num_ranks: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


def _apply(launch: Launch) -> None:
    if launch.cpus is not None:
        os.sched_setaffinity(0, launch.cpus)
    if launch.threads is not None:
        torch.set_num_threads(launch.threads)


class Ranks:
    """Rank 0's handle on the world: the workers it started, the control channel, shutdown."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._processes: dict[int, BaseProcess] = {}
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        self._stopped = False
        self.comm: Comm | None = None
        launch = env_launch(config)
        if launch is not None and launch.rank != 0:
            raise ValueError(f"RANK={launch.rank}: the engine runs on rank 0; start the other ranks with "
                             "`mini-infer worker` and the same engine flags")
        if launch is None:
            launch = self._spawn_workers(config)
        self.launch = launch
        try:
            _apply(launch)
            self.comm = self._join(launch)
        except BaseException:
            self.shutdown()
            raise

    def _spawn_workers(self, config: EngineConfig) -> Launch:
        world = config.world_size
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        threads = _cpu_threads(world)
        context = process_context()
        for rank in range(1, world):
            launch = Launch(rank, world, init_method, rank_device(config.device, rank), cpu_share(rank, world),
                            threads)
            process = new_process(context, worker_main, (config, launch), name=f"mini-infer:r{rank}", daemon=True)
            process.start()
            self._processes[rank] = process
        return Launch(0, world, init_method, rank_device(config.device, 0), cpu_share(0, world), threads)

    def _join(self, launch: Launch) -> Comm:
        """init_process_groups, watching the started workers meanwhile: one that dies before joining would
        otherwise leave rank 0 waiting for the whole timeout."""
        result: dict = {}

        def join() -> None:
            try:
                result["comm"] = init_process_groups(self.config, 0, launch.world_size, launch.init_method,
                                                     launch.device, TIMEOUT_S)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=join, name="mini-infer-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self.dead_workers()
            if dead and thread.is_alive():
                raise WorkerDiedError(f"{dead} before joining the engine's world")
        if "error" in result:
            raise result["error"]
        return result["comm"]

    @property
    def device(self) -> torch.device:
        return self.launch.device

    def dead_workers(self) -> str | None:
        """A description of the started workers that have exited, or None while all live."""
        dead = [(rank, p) for rank, p in self._processes.items() if p.exitcode is not None]
        if not dead:
            return None
        return ", ".join(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}" for rank, p in dead)

    # ---- what rank 0 tells the others ----

    def wait_ready(self) -> None:
        """Every rank has loaded its shard."""
        self.guard(dist.barrier, group=self.comm.control)

    def broadcast_step(self, plan) -> None:
        """The step's plan (plain data, small) to every other rank."""
        self.guard(dist.broadcast_object_list, [("step", plan)], src=0, group=self.comm.control)

    def gather_stats(self, own: dict) -> list[dict]:
        self.guard(dist.broadcast_object_list, [("stats", None)], src=0, group=self.comm.control)
        stats = [None] * self.launch.world_size
        self.guard(dist.gather_object, own, stats, dst=0, group=self.comm.control)
        return stats

    def guard(self, function, *args, **kwargs):
        """function(*args, **kwargs). If it fails, every worker is stopped; a failure that a dead worker caused
        becomes WorkerDiedError naming it, any other error propagates as it is."""
        try:
            return function(*args, **kwargs)
        except BaseException as e:
            failure = self._failure(e)
            if failure is e:
                raise
            raise failure from e

    def _failure(self, error: BaseException) -> BaseException:
        """Stop the workers; name the dead one when one of ours died (it may take a moment to be reaped)."""
        by_sentinel = {p.sentinel: p for p in self._processes.values()}
        # A sentinel fires as the process closes its files, a moment before it can be reaped: join those.
        for sentinel in wait(list(by_sentinel), timeout=5.0) if by_sentinel else ():
            by_sentinel[sentinel].join(5.0)
        dead = self.dead_workers()
        self.shutdown(graceful=False)
        if dead is not None:
            return WorkerDiedError(f"{dead}; the engine has stopped and shut its other workers down")
        if not self._processes and isinstance(error, RuntimeError):  # torchrun-style: not ours to watch
            return WorkerDiedError(f"a step failed on rank 0, the engine has stopped (if the error names a "
                                   f"connection, another rank went away): {error}")
        return error

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (asking first when `graceful`), leave the world, restore rank 0's threads and cores.
        Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        if graceful and self.comm is not None and self.dead_workers() is None:
            try:
                dist.broadcast_object_list([("stop", None)], src=0, group=self.comm.control)
            except RuntimeError:
                pass  # a worker went away meanwhile; it is reaped below either way
        for process in self._processes.values():
            process.join(STOP_GRACE_S if graceful else 0.5)
            if process.is_alive():
                process.kill()
                process.join(STOP_GRACE_S)
        if self.comm is not None and self.comm.shm_all_reduce is not None:
            self.comm.shm_all_reduce.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        cpus, threads = self._saved
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)


def worker_main(config: EngineConfig, launch: Launch) -> None:
    """A rank other than 0: load this rank's shard, then run what rank 0 broadcasts until it says stop."""
    from mini_infer.runner.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; rank 0 stops us
    _apply(launch)
    comm = init_process_groups(config, launch.rank, launch.world_size, launch.init_method, launch.device, TIMEOUT_S)
    runner = ModelRunner(config, config.resolved_num_kv_blocks(), comm, launch.device)
    try:
        dist.barrier(group=comm.control)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=comm.control)
            kind, payload = box[0]
            if kind == "step":
                runner.execute(payload)
            elif kind == "stats":
                dist.gather_object(runner.memory_stats(), None, dst=0, group=comm.control)
            else:
                break
    except RuntimeError as e:  # rank 0 or a peer went away: nothing left to serve
        print(f"mini-infer worker rank {launch.rank}: stopping: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    dist.destroy_process_group()


def run_worker(config: EngineConfig) -> None:
    """`mini-infer worker`: this process is the rank the torchrun-style environment names (not 0)."""
    launch = env_launch(config)
    if launch is None or launch.rank == 0:
        raise ValueError("mini-infer worker runs ranks 1..WORLD_SIZE-1 of a torchrun-style launch: set RANK (>= 1), "
                         "WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 runs the engine command itself")
    worker_main(config, launch)
