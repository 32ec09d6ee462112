"""Which matmul runs a linear layer on this machine: one of the native kernels that run here (AVX2, AVX-512F,
AVX512_BF16, AMX) or torch's own (oneDNN, which uses AVX512_BF16 or AMX where the CPU has them), timed once per weight
shape and batch-size bucket.

The choice is cached on disk, keyed by everything that decides it: the CPU model and its instruction sets, torch's
version, the kernel's source, the thread count, the dtype and how the timing is done. A changed key times again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mini_infer import machine
from mini_infer.kernels import cpu
from mini_infer.kernels.quant import QUANT_KERNELS
from mini_infer.paths import cache_dir

# Rows of the activation (tokens in a step): decode batches up to 64, then prefill chunk sizes.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Every candidate name a cached table may hold (a machine times the ones it can run): the native paths for float
# weights (kernels/cpu.py) and for quantised ones (kernels/quant.py; a table holds one kind), and torch's matmul.
CANDIDATES = tuple(dict.fromkeys((*cpu.MATMUL_PATHS, *QUANT_KERNELS, "torch")))
_ROUNDS = 5  # timed calls per candidate and bucket
_SLOW_ROUNDS = 3  # where a call takes longer than _SLOW_S (a prefill of the LM head, say): steady enough
_SLOW_S = 0.02
# How the candidates are timed (part of the cache key: a table timed another way is timed again).
_METHOD = "warm-up, then interleaved rounds; decode buckets with the weight flushed from the caches"


def bucket_index(rows: int) -> int:
    """The bucket a matmul of `rows` rows is timed as: the smallest at least as large, else the largest."""
    for i, size in enumerate(BUCKETS):
        if rows <= size:
            return i
    return len(BUCKETS) - 1


def cpu_identity() -> str:
    """The CPU model and the instruction sets that decide matmul speed."""
    return f"{machine.cpu().model} [{','.join(machine.cpu().isa)}]"


def machine_key(dtype: torch.dtype, kernel_key: str) -> str:
    """What the timings depend on besides the shape: the machine, torch, the threads, the dtype, how they are
    timed, and the kernels' build key (their sources and headers, flags and compiler: cpu.build_key)."""
    parts = [cpu_identity(), torch.__version__, str(torch.get_num_threads()), str(dtype), _METHOD,
             hashlib.sha256(kernel_key.encode()).hexdigest()[:16]]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def timed_ms(run: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """One call of `run` in ms; `before` (untimed) runs first."""
    if before is not None:
        before()
    start = time.perf_counter()
    run()
    return 1000 * (time.perf_counter() - start)


class LinearTuner:
    """Per weight shape, the faster candidate for every bucket, timed on first use and kept in the cache file."""

    def __init__(self, key: str, timer: Callable[[str, int, int, int], float], candidates: tuple[str, ...],
                 path: Path | None = None, arithmetic: Callable[[str], str] | None = None) -> None:
        """timer(candidate, rows, out_features, in_features) -> the ms of one call, for each of `candidates`.
        arithmetic (deterministic mode): candidate -> its arithmetic (cpu.MatmulPath.arithmetic); every bucket of a
        weight shape then takes a candidate of one arithmetic, so a row's numbers do not depend on the row count."""
        assert set(candidates) <= set(CANDIDATES), candidates
        self.timer, self.candidates, self.arithmetic = timer, candidates, arithmetic
        self.path = path or cache_dir() / "autotune" / f"linear-{key}.json"
        self._table: dict[str, list[str]] = self._load()

    def _load(self) -> dict[str, list[str]]:
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        valid = isinstance(table, dict) and all(isinstance(v, list) and len(v) == len(BUCKETS) and
                                                set(v) <= set(self.candidates) for v in table.values())
        return table if valid else {}

    def winners(self, out_features: int, in_features: int) -> tuple[str, ...]:
        name = f"{out_features}x{in_features}"
        if name not in self._table:
            self._table = {**self._load(), **self._table}  # another process may have timed it meanwhile
        if name not in self._table:
            print(f"[mini-infer] timing the matmul paths for a {out_features} x {in_features} weight once "
                  f"(cached in {self.path.parent})", file=sys.stderr)
            medians = [self._medians(rows, out_features, in_features) for rows in BUCKETS]
            self._table[name] = ([min(m, key=m.get) for m in medians] if self.arithmetic is None
                                 else one_arithmetic(medians, self.arithmetic))
            self._save()
        return tuple(self._table[name])

    def _medians(self, rows: int, out_features: int, in_features: int) -> dict[str, float]:
        """Each candidate's median time: each called once to warm it (first-touch pages, oneDNN's primitive cache),
        then timed in rounds that call every candidate in turn. The machine's speed drifts within seconds (a
        neighbour's burst once made the slower of two LM-head matmuls win by 50 %); interleaved, the drift falls on
        every candidate alike."""
        warm = [self.timer(c, rows, out_features, in_features) for c in self.candidates]
        rounds = _SLOW_ROUNDS if max(warm) > 1000 * _SLOW_S else _ROUNDS
        samples: dict[str, list[float]] = {c: [] for c in self.candidates}
        for _ in range(rounds):
            for candidate in self.candidates:
                samples[candidate].append(self.timer(candidate, rows, out_features, in_features))
        return {c: statistics.median(samples[c]) for c in self.candidates}

    def choices(self) -> dict[str, list[str]]:
        """Per weight shape ("NxK") timed so far, the winner of every bucket (BUCKETS), for reports."""
        return {name: list(winners) for name, winners in self._table.items()}

    def _save(self) -> None:
        """Merged with what other processes (ranks, replicas, other engines) saved meanwhile, under a lock, and
        replaced atomically, so that no process reads half a file or drops another's shapes."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._table = {**self._load(), **self._table}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._table, f, indent=1)
            os.replace(tmp, self.path)


def one_arithmetic(medians: list[dict[str, float]], arithmetic: Callable[[str], str]) -> list[str]:
    """Per bucket (medians: each bucket's candidate -> ms), the fastest candidate of the one arithmetic that costs
    least over all the buckets: the lowest geometric mean of its best time over the bucket's best."""
    def best(times: dict[str, float], kind: str) -> str:
        return min((c for c in times if arithmetic(c) == kind), key=times.get)

    def cost(kind: str) -> float:
        return sum(math.log(times[best(times, kind)] / min(times.values())) for times in medians)

    chosen = min(sorted({arithmetic(c) for c in medians[0]}), key=cost)
    return [best(times, chosen) for times in medians]


def describe_choices(choices: dict[str, list[str]]) -> list[str]:
    """One line per weight shape: each winner with the bucket sizes it won, e.g. "896x896: avx2 at 1-2, torch at
    4-512" (a bucket of size b covers the row counts above the previous bucket up to b)."""
    lines = []
    for shape, winners in choices.items():
        runs: list[tuple[str, int, int]] = []
        for size, winner in zip(BUCKETS, winners):
            if runs and runs[-1][0] == winner:
                runs[-1] = (winner, runs[-1][1], size)
            else:
                runs.append((winner, size, size))
        spans = ", ".join(f"{w} at {lo}" if lo == hi else f"{w} at {lo}-{hi}" for w, lo, hi in runs)
        lines.append(f"{shape}: {spans}")
    return lines
