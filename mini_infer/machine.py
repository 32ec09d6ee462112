"""The machine mini-infer runs on, read once: the CPU's model name and instruction-set flags (/proc/cpuinfo) and the
cores this process may use. The kernels choose their builds by it, the autotuner keys its timings by it, and the
benchmarks describe it."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that decide which native kernels build and how fast low-precision matmuls run.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True, slots=True)
class Cpu:
    model: str
    flags: frozenset[str]

    @property
    def isa(self) -> tuple[str, ...]:
        """The ISA_FLAGS this CPU has, in their order."""
        return tuple(flag for flag in ISA_FLAGS if flag in self.flags)


@functools.cache
def cpu() -> Cpu:
    """The first processor's model name and flags from /proc/cpuinfo (no flags where there is none)."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return Cpu(fields.get("model name") or platform.processor() or platform.machine(),
               frozenset(fields.get("flags", "").split()))


def available_memory() -> int | None:
    """The bytes the kernel reckons it could give this process now (/proc/meminfo's MemAvailable; None where there is
    no such file)."""
    meminfo = Path("/proc/meminfo")
    for line in meminfo.read_text().splitlines() if meminfo.is_file() else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which torch's threads and the ranks share."""
    return len(os.sched_getaffinity(0))
