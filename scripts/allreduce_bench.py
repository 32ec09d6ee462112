"""Latency of the tensor-parallel all-reduce between two CPU ranks on this machine: gloo (torch.distributed)
against mini-infer's shared-memory all-reduce, for a decode step's hidden states of the Qwen2.5-0.5B shape
([rows, 896] bfloat16), with each rank pinned to its own core and one torch thread, as `-tp 2` runs them.

    .venv/bin/python scripts/allreduce_bench.py 1 8 256
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mini_infer.distributed.shm import ShmAllReduce

HIDDEN = 896
REPS = 300


def rank_main(rank: int, port: int, rows: list[int]) -> None:
    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = ShmAllReduce(dist.group.WORLD, rank, 2, leader=0)
    for m in rows:
        x = torch.ones(m, HIDDEN, dtype=torch.bfloat16)
        times = {}
        for name, reduce in (("gloo", lambda t: dist.all_reduce(t)), ("shared memory", shm)):
            for _ in range(20):
                reduce(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(REPS):
                reduce(x)
            times[name] = (time.perf_counter() - start) / REPS
        if rank == 0:
            print(f"[{m}, {HIDDEN}] bf16: gloo {times['gloo'] * 1e6:8.1f} us, shared memory "
                  f"{times['shared memory'] * 1e6:6.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    sizes = [int(a) for a in sys.argv[1:]] or [1, 8, 256]
    other = mp.get_context("spawn").Process(target=rank_main, args=(1, free_port, sizes))
    other.start()
    rank_main(0, free_port, sizes)
    other.join()
