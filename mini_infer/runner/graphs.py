"""CUDA graphs for decode steps: the model's layers captured once per padded batch size, then replayed with each
step's batch copied into their static input buffers (one launch of the whole step instead of hundreds).

Sizes 1, 2, 4, 8, then every 8 up to 256 and every 16 up to 512 (capped at max_num_seqs), captured largest first
into one memory pool. A step of n requests replays the smallest size >= n: its first n rows are the batch, the rest
padding (slot -1, so nothing is stored; context length 0, so attention reads nothing). Prefill and mixed steps, and
batches past the largest size, run eagerly. The LM head and the sampler run after the graph, on the rows that
sample.

On the CPU, where the Triton kernels run in the interpreter for tests, `EmulatedGraph` stands in for the CUDA graph:
"capture" runs the step under a dispatch mode that refuses host syncs and host data, and "replay" runs the same
closure again into the captured outputs, so a step that read anything but its static buffers gives wrong tokens.
A size's stand-in is captured when a step first needs it (there is no memory pool to share, and capturing every
size up front cost ~2.7 s an engine in the interpreter, for sizes most tests never run).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mini_infer.runner.input_batch import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# Run the layers of a decode step: (input ids [n], positions [n], slot mapping [n], block tables [n, blocks], context
# lengths [n]) -> (hidden rows [n, hidden], residual rows [n, hidden]).
LayersFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes a graph is captured for, ascending: 1, 2, 4, 8, every 8 to 256, every 16 to 512, the
    largest being min(max_num_seqs, 512)."""
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [size for size in sizes if size < largest] + [largest]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs requests (None past the largest: the step runs eagerly)."""
    at = bisect.bisect_left(sizes, num_seqs)
    return sizes[at] if at < len(sizes) else None


@dataclass(slots=True)
class StaticInputs:
    """A graph's inputs: device buffers of the largest size's rows (a graph of n rows reads the first n) and the host
    staging they are copied from (pinned on a CUDA device, so the copies run without blocking the host)."""

    host: dict[str, torch.Tensor]
    device: dict[str, torch.Tensor]
    copied: torch.cuda.Event | None = None  # the last fill's copies (CUDA): the staging is rewritten only after them

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> StaticInputs:
        shapes = {"input_ids": (rows,), "positions": (rows,), "slot_mapping": (rows,), "context_lens": (rows,),
                  "block_tables": (rows, max_blocks)}
        pinned = device.type == "cuda"
        static = cls({name: torch.zeros(shape, dtype=torch.int64, pin_memory=pinned) for name, shape in shapes.items()},
                     {name: torch.zeros(shape, dtype=torch.int64, device=device) for name, shape in shapes.items()})
        for buffers in (static.host, static.device):  # the capture-time runs store nothing in the caches
            buffers["slot_mapping"].fill_(-1)
        return static

    def fill(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode step's inputs (n requests, one token each) into the first n rows and pad rows n..size-1 (slot
        -1, context 0, token and position 0); then the host staging to the device, without waiting for it."""
        host, n = self.host, inputs.num_tokens
        width = inputs.block_tables.shape[1]
        if self.copied is not None:  # a step that sampled nothing did not wait for its copies
            self.copied.synchronize()
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("context_lens", 0)):
            host[name][:n] = getattr(inputs, name)
            host[name][n:size] = pad
        host["block_tables"][:n, :width] = inputs.block_tables
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            self.device[name][:size].copy_(host[name][:size], non_blocking=True)
        self.device["block_tables"][:n, :width].copy_(host["block_tables"][:n, :width], non_blocking=True)
        if host["input_ids"].is_pinned():
            self.copied = torch.cuda.Event()
            self.copied.record()

    def rows(self, size: int) -> tuple[torch.Tensor, ...]:
        """The device buffers' first `size` rows, in LayersFn's order."""
        return tuple(self.device[name][:size] for name in ("input_ids", "positions", "slot_mapping", "block_tables",
                                                           "context_lens"))


class HostSyncRefused(RuntimeError):
    """A captured step asked for something a CUDA graph cannot replay."""


class _RefuseHostSyncs(TorchDispatchMode):
    """Raises on the ops a CUDA graph cannot hold: reading a device value on the host (.item(), int(), bool()), outputs
    whose shape depends on the data (nonzero, masked_select, unique, indexing by a boolean mask), and tensors made
    from host data mid-step (torch.tensor(...): a graph would replay their capture-time values)."""

    REFUSED = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
               "unique_dim", "is_nonzero", "equal", "lift_fresh"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1] or ())
        if name in self.REFUSED or boolean_index:
            raise HostSyncRefused(f"{func}{' with a boolean mask' if boolean_index else ''} in a captured decode step")
        return func(*args, **(kwargs or {}))


class EmulatedGraph:
    """The CPU's stand-in for a CUDA graph: capture runs `fn` under _RefuseHostSyncs and keeps its outputs; replay runs
    `fn` again and copies its results into those outputs, as a CUDA graph's replay rewrites its own."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.fn = fn
        with _RefuseHostSyncs():
            self.outputs = fn()

    def replay(self) -> None:
        with _RefuseHostSyncs():
            for output, new in zip(self.outputs, self.fn()):
                output.copy_(new)


class CudaGraph:
    """A torch CUDA graph of `fn`, captured into `pool` after one eager run (Triton compiles its kernels for this
    size there, cuBLAS picks its algorithms)."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]], pool) -> None:
        fn()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()

    def replay(self) -> None:
        self.graph.replay()


@dataclass(frozen=True, slots=True)
class CaptureReport:
    sizes: list[int]
    seconds: float
    memory_bytes: int | None  # device memory the graphs took (CUDA only)


class DecodeGraphs:
    """The graphs of one model's decode steps, one per capture size, sharing their static inputs and memory pool."""

    def __init__(self, layers: LayersFn, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.sizes = capture_sizes(max_num_seqs)
        self.static = StaticInputs.allocate(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, CudaGraph | EmulatedGraph] = {}

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
                self.graphs[size] = CudaGraph(self._step(size), pool)
        memory = None
        if cuda:
            torch.cuda.synchronize(self.device)
            memory = free_before - torch.cuda.mem_get_info(self.device)[0]
        report = CaptureReport(self.sizes, time.perf_counter() - start, memory)
        if cuda:
            logger.info("captured %d decode graphs (batch sizes %d-%d) in %.1f s, %.0f MiB", len(self.sizes),
                        self.sizes[0], self.sizes[-1], report.seconds, memory / 2**20)
        return report

    def _step(self, size: int) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The decode step over the static buffers' first `size` rows."""
        return lambda: self.layers(*self.static.rows(size))

    def run(self, inputs: StepInputs, edit_ids: Callable[[torch.Tensor, StepInputs], None] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers' outputs (hidden, residual) for a decode step's n rows from its graph, or None where the step is
        not one a graph holds (a prompt chunk in it, or more requests than the largest size). edit_ids(ids, inputs)
        may change the static input ids of the n rows on the device before the replay."""
        n = inputs.num_tokens
        if inputs.num_decodes != len(inputs.context_lens_host) or n != inputs.num_decodes:
            return None
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        self.static.fill(inputs, size)
        if edit_ids is not None:
            edit_ids(self.static.device["input_ids"][:n], inputs)
        graph = self.graphs.get(size)
        if graph is None:  # (the CPU's stand-in, at its first step: its capture runs this step, the replay again)
            graph = self.graphs[size] = EmulatedGraph(self._step(size))
        graph.replay()
        hidden, residual = graph.outputs
        return hidden[:n], residual[:n]
