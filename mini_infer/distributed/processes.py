"""How an engine starts its other processes (its tensor/pipeline ranks, its data-parallel replicas): forked from
multiprocessing's fork server, which has imported mini-infer (torch with it) once, rather than spawned, where every
new process imported it all again before loading anything (~1.5-2 s of CPU each on a 2-core Zen 3).

The server is a fresh interpreter (exec'd, never forked from a process that runs threads or has initialised CUDA)
that imports mini_infer and nothing else, and lives as long as the process that started it. A process forked from
it begins from the server's state, not its parent's: so each is given its parent's environment as it is at the
start (what a spawned process inherits), and names itself (its comm, what ps and top show) after its role.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

# What the server imports before it forks anything: the package, which imports the engine and torch.
PRELOAD = ["mini_infer"]
PR_SET_NAME = 15  # prctl: the calling thread's name (a process's main thread: its comm), at most 15 bytes


def process_context() -> BaseContext:
    """The multiprocessing context the engine's processes start from (its Pipes and Queues too)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def new_process(context: BaseContext, target: Callable, args: tuple, name: str,
                daemon: bool | None = None) -> BaseProcess:
    """A process (not started) that runs target(*args) in this process's current environment, named `name` (at most
    15 characters) in multiprocessing and in the operating system."""
    return context.Process(target=_child_main, args=(dict(os.environ), name, target, args), name=name, daemon=daemon)


def _child_main(environ: dict[str, str], name: str, target: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)  # (a name is a convenience: a failure changes nothing)
    target(*args)
