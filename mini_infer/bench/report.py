"""What every bench report shares: a system's run result, summary statistics, the machine and versions, and
the one table printer (rows are dicts, columns name the key they show)."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from mini_infer import machine

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def count_output_tokens(token_ids: Sequence[Sequence[int]]) -> int:
    """Generated tokens over all requests: the number of generated ids each request returned."""
    return sum(len(ids) for ids in token_ids)


@dataclass(slots=True)
class RunResult:
    token_ids: list[list[int]]  # each request's generated ids, in submission order
    finish_s: list[float]  # each request's finish time, in seconds after the run started
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return count_output_tokens(self.token_ids)


def machine_info(device: str = "cpu") -> dict:
    """CPU model, cores, torch's threads, the CPU flags that decide low-precision matmul speed, and the load
    average (call it before the measurements: other busy processes slow every system down); on a CUDA device also
    the GPU's name, multiprocessors and memory."""
    cpu = machine.cpu()
    info = {"cpu_model": cpu.model, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_flags": {flag: flag in cpu.flags for flag in CPU_FLAGS}, "load_average_1m": os.getloadavg()[0]}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": props.name, "multiprocessors": props.multi_processor_count,
                       "memory_bytes": props.total_memory, "cuda": torch.version.cuda}
    return info


def describe_machine(machine: dict) -> str:
    gpu = machine.get("gpu")
    on_gpu = (f"{gpu['name']} ({gpu['multiprocessors']} SMs, {gpu['memory_bytes'] / 2**30:.0f} GiB, CUDA "
              f"{gpu['cuda']}); host: ") if gpu else ""
    return (f"{on_gpu}{machine['torch_threads']} torch threads on {machine['cpu_cores']} cores "
            f"({machine['cpu_model']}), load average {machine['load_average_1m']:.2f} at start")


def _installed(package: str) -> str | None:
    """From the installed metadata: reading transformers' version must not import it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": _installed("transformers"), "mini_infer": _installed("mini-infer")}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated linearly between the closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def speedup(value: float, base: float | None) -> float | None:
    return value / base if base else None


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: its header, the row key it shows (None: the whole row), a str.format spec for the value,
    and a scale applied to a numeric value first (1e3 for seconds shown as ms)."""

    header: str
    key: str | None
    fmt: str = "{}"
    scale: float = 1.0

    def cell(self, row: dict) -> str:
        """Blank where the row lacks the key, "-" where its value is None."""
        if self.key is not None and self.key not in row:
            return ""
        value = row if self.key is None else row[self.key]
        if value is None:
            return "-"
        return self.fmt.format(value * self.scale if self.scale != 1 else value)


def format_table(columns: Sequence[Column], rows: Sequence[dict | None]) -> str:
    """Columns padded to their widest cell, the first left-aligned and the others right-aligned; a None row is
    a rule, and a column blank in every row is left out."""
    cells = [None if row is None else [c.cell(row) for c in columns] for row in rows]
    keep = [i for i in range(len(columns)) if any(r is not None and r[i] for r in cells)]
    table = [[columns[i].header for i in keep]] + [r if r is None else [r[i] for i in keep] for r in cells]
    widths = [max(len(r[j]) for r in table if r is not None) for j in range(len(keep))]
    rule = "  ".join("-" * w for w in widths)
    lines = [rule if r is None else "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                                              for j, (c, w) in enumerate(zip(r, widths))) for r in table]
    return "\n".join([lines[0], rule, *lines[1:]])


@dataclass(frozen=True, slots=True)
class Workload:
    """A `bench --workload`: run(options, model_dir, log) measures and returns the report's body; its table is
    headline(report) (the machine's line goes after the first line), then `columns` over rows(report); chart(report)
    gives the PNG's title and panels."""

    run: Callable
    headline: Callable[[dict], list[str]]
    columns: tuple[Column, ...]
    rows: Callable[[dict], list[dict]]
    chart: Callable[[dict], tuple[str, list]]


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
