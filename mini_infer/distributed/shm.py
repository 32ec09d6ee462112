"""The tensor-parallel all-reduce of ranks on one machine, through shared memory instead of gloo.

Profiled on the 2-core VMs here: a gloo all-reduce of one decode step's hidden states ([8, 896] bf16) takes
~2 ms between two processes on loopback, and a tp=2 decode step of the 0.5B shape makes 49 of them (~100 ms of a
~200 ms step). Through a shared segment (mini_infer/kernels/shm_allreduce.cpp) it is a copy, a flag and a sum.
The group's first rank creates the segment under /dev/shm, every rank maps it, and the file is unlinked as soon
as all have: nothing is left behind however the processes end. A rank waiting for the others spins; a watchdog
thread in every rank checks the others' processes every 0.1 s and, once one has exited, aborts the segment, so
the waiting ranks raise instead of spinning forever (a worker killed mid-step, or rank 0 killed under its
workers).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from mini_infer.kernels import cpu

SLOT_BYTES = 4 << 20  # per rank and buffer; larger tensors go through in chunks
MAX_RANKS = 64  # the kernel's table of slots (shm_allreduce.cpp: sum_slots)
_LINE = 64
SHM_DIR = Path("/dev/shm")


class ShmAllReduce:
    def __init__(self, group, rank: int, world: int, leader: int, timeout_s: float = 300.0) -> None:
        """rank: this process's index in the group; leader: the group's first global rank (creates the file);
        timeout_s: how long a call may wait for a peer that is alive but silent (stopped, say)."""
        if world > MAX_RANKS:
            raise ValueError(f"the shared-memory all-reduce takes at most {MAX_RANKS} ranks, got {world}")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._waiting_since: float | None = None
        nbytes = (world + 1) * _LINE + 2 * world * SLOT_BYTES
        box = [None]
        if rank == 0:
            path = SHM_DIR / f"mini-infer-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            box = [str(path)]
        dist.broadcast_object_list(box, src=leader, group=group)
        self.segment = torch.from_file(box[0], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(box[0])
        self.seq = 1  # flags start at 0 in the fresh file
        pids = [None] * world
        dist.all_gather_object(pids, os.getpid(), group=group)
        self._abort = self.segment[world * _LINE: world * _LINE + 8].view(torch.int64)
        self._stop = threading.Event()
        self.gone: int | None = None  # the pid whose exit aborted the segment
        self._watchdog = threading.Thread(target=self._watch, args=([p for p in pids if p != os.getpid()],),
                                          name="mini-infer-shm-watchdog", daemon=True)
        self._watchdog.start()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._waiting_since = time.monotonic()
        try:
            rounds = cpu.shm_allreduce(self.segment, self.rank, self.world, SLOT_BYTES, self.seq, x)
        finally:
            self._waiting_since = None
        if rounds < 0:
            if self.gone is None:
                raise RuntimeError(f"shared-memory all-reduce aborted: a tensor-parallel peer did not answer within "
                                   f"{self.timeout_s:g} s (a stopped process, or one of this rank's peers timed out)")
            raise RuntimeError(f"shared-memory all-reduce aborted: the process of a tensor-parallel peer "
                               f"(pid {self.gone}) has exited")
        self.seq += rounds
        return x

    def close(self) -> None:
        self._stop.set()

    def _watch(self, peers: list[int]) -> None:
        """Abort the segment when a peer's process has exited, or when this rank has waited past the timeout
        (the kernel call releases the GIL, so this thread runs while it spins)."""
        while not self._stop.wait(0.1):
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._abort.fill_(1)
                return
            for pid in peers:
                if not _alive(pid):
                    self.gone = pid
                    self._abort.fill_(1)
                    return


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def shm_unavailable_reason(group, device: torch.device) -> str | None:
    """Why the group's ranks cannot share memory (None when they can): they must all run on this machine's CPU,
    with the all-reduce kernel built and /dev/shm present. Called by every rank of the group."""
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, os.uname().nodename, group=group)
    if device.type != "cpu":
        return f"ranks run on {device.type}"
    if len(set(names)) > 1:
        return f"ranks on {len(set(names))} machines"
    if not SHM_DIR.is_dir():
        return f"no {SHM_DIR}"
    if len(names) > MAX_RANKS:
        return f"more than {MAX_RANKS} ranks"
    reason = cpu.kernel_reason("shm_allreduce")
    return f"its native kernel is unavailable: {reason}" if reason else None
