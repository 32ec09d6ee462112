"""What a benchmark report holds besides its measurements: the machine, the versions, summary statistics, and
the plain-text table printed on the terminal."""

from __future__ import annotations

import json
import os
import platform
import statistics
from importlib import metadata
from pathlib import Path

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_info() -> dict:
    """CPU model, cores, torch's thread count, the CPU flags that decide low-precision matmul speed, and the
    load average (call it before the measurements)."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = {}
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        # Other busy processes slow every system down, HF's OpenMP-threaded ops the most.
        "load_average_1m": os.getloadavg()[0],
    }


def describe_machine(machine: dict) -> str:
    return (f"{machine['torch_threads']} torch threads on {machine['cpu_cores']} cores ({machine['cpu_model']}), "
            f"load average {machine['load_average_1m']:.2f} at start")


def versions() -> dict:
    from mini_infer import __version__

    try:  # from the installed metadata: reading the version must not import transformers
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers_version, "mini_infer": __version__}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated linearly between the closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
