"""Where a peer system lives: its own virtual environment under cache_dir()/peers/<name>, set up once by a
recipe's commands, and the worker subprocess that decodes in it, spoken to in JSON lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mini_infer.paths import cache_dir

WORKERS_DIR = Path(__file__).parent / "workers"


class PeerUnavailable(RuntimeError):
    """A peer that cannot be set up or started here; its message is the one-line reason the bench shows."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """The commands that set up a peer's environment, in order. In each argument {base} is the bench's own
    Python, {venv} the environment's folder, {python} its Python and {root} the peer's folder."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    minutes: int  # about how long the first setup takes on 2 cores, for the message
    env: dict[str, str] = field(default_factory=dict)
    record: dict = field(default_factory=dict)  # how it was set up (versions, build flags), kept in the report


class PeerVenv:
    """cache_dir()/peers/<name>: venv/, setup.log, and ready.json once every step of the recipe succeeded."""

    def __init__(self, name: str) -> None:
        self.root = cache_dir() / "peers" / name
        self.venv = self.root / "venv"
        self.python = self.venv / "bin" / "python"
        self.log_path = self.root / "setup.log"

    @property
    def marker(self) -> Path:
        return self.root / "ready.json"

    def ensure(self, recipe: Recipe, log: Callable[[str], None]) -> dict:
        """The recipe's record once set up: read from ready.json, or by running the recipe now (a partial
        environment from an earlier failure is removed first)."""
        if self.marker.is_file():
            return json.loads(self.marker.read_text())
        log(f"{recipe.name}: first use, setting it up in {self.root} (about {recipe.minutes} min on 2 cores, "
            f"once; log in {self.log_path})")
        if self.venv.exists():
            shutil.rmtree(self.venv)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        for step in recipe.steps:
            self._run(recipe.name, [self._fill(arg) for arg in step], recipe.env)
        self.marker.write_text(json.dumps(recipe.record, indent=2) + "\n")
        log(f"{recipe.name}: set up")
        return recipe.record

    def _fill(self, arg: str) -> str:
        return arg.format(base=sys.executable, venv=self.venv, python=self.python, root=self.root)

    def _run(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with self.log_path.open("a") as out:
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            code = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **env}).returncode
        if code != 0:
            raise PeerUnavailable(f"{name} setup failed: `{' '.join(argv[:6])}` exited {code} "
                                  f"({last_line(self.log_path)}); full log {self.log_path}")


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def parse_answer(line: str, name: str) -> dict:
    """One line of a worker's stdout as its answer; an {"error": ...} answer raises with the worker's message."""
    try:
        answer = json.loads(line)
    except json.JSONDecodeError as error:
        raise RuntimeError(f"{name} worker answered with a line that is not JSON: {line[:200]!r}") from error
    if not isinstance(answer, dict):
        raise TypeError(f"{name} worker answered with {type(answer).__name__}, not a JSON object")
    if "error" in answer:
        raise RuntimeError(f"{name} worker: {answer['error']}")
    return answer


class Worker:
    """A worker script (workers/) under the peer's Python: it takes its settings as one JSON argument, answers
    {"ready": {...}} once loaded, then one JSON line for each JSON line it is sent; its stderr goes to a log."""

    def __init__(self, name: str, python: Path | str, script: Path, settings: dict, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.process = subprocess.Popen([str(python), str(script), json.dumps(settings)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env={**os.environ, **(env or {})})
        try:
            self.ready = self._answer()["ready"]
        except BaseException:
            self.close()
            raise

    def call(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            self._log.flush()
            raise RuntimeError(f"{self.name} worker exited with {code}: {last_line(self.log_path)} "
                               f"(log {self.log_path})")
        return parse_answer(line, self.name)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
