"""Compile a kernel source shipped with the package into a shared library, once per source and compiler.

The library lands in the mini-infer cache dir, named by a hash of the source, flags and compiler version, so
an edited kernel or another compiler rebuilds it; parallel processes race safely (atomic rename).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mini_infer.paths import cache_dir


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or run on this machine; the message says why."""


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache
def _version(compiler: str) -> str:
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def compiler_version() -> str:
    """The C++ compiler's name and `--version` (KernelUnavailable where there is none)."""
    return f"{compiler()}\0{_version(compiler())}"


def build_library(source: Path, flags: list[str], headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """headers: the local headers the source includes (part of the cache key)."""
    compiler, version = os.environ.get("CXX", "g++"), compiler_version()
    texts = [path.read_text() for path in (source, *headers)]
    digest = hashlib.sha256("\0".join([*texts, *flags, version]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(partial), str(source)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelUnavailable(f"{compiler} failed to build {source.name}: {result.stderr.strip()[:500]}")
            os.replace(partial, target)
    return ctypes.CDLL(str(target))
