"""The package's layers import downward only, and no modules import each other in a circle.

Every import of every module counts, the ones inside functions too: a lazy import still ties the two modules
together. Layers, bottom up: the shared leaves, the checkpoint factory, kernels, distributed (the model's
communication primitives), model, runner, executor (the rank processes), engine, bench, entrypoints (with the
package's root and the LLM class).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mini_infer"
LEAVES = {"config", "speculative_config", "gguf_file", "sampling_params", "pooling_params", "outputs", "errors",
          "paths", "profiling", "machine"}
LAYERS = ["factory", "kernels", "distributed", "model", "runner", "executor", "engine", "bench", "entrypoints"]
ENTRYPOINT_MODULES = {"__init__", "llm"}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The project module an import names: itself, or the package or module it is inside."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(path, package_dir): path for path in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for candidate in candidates:
                if candidate.split(".")[0] == "mini_infer":
                    target = resolve(candidate, set(files))
                    if target is not None and target != name:
                        targets.add(target)
                        break  # `from a.b import c`: c if it is a module, else a.b
        graph[name] = targets
    return graph


def layer_of(module: str) -> tuple[int, str]:
    """(level, unit): modules of one unit may import each other; units of a level may not."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in LEAVES:
        return 0, top
    if top in ENTRYPOINT_MODULES:
        return 1 + LAYERS.index("entrypoints"), "entrypoints"
    assert top in LAYERS, f"{module}: a package this test does not place in a layer; add it to LAYERS"
    return 1 + LAYERS.index(top), top


def test_imports_go_downward_only():
    upward = []
    for module, targets in sorted(import_graph().items()):
        level, unit = layer_of(module)
        for target in sorted(targets):
            target_level, target_unit = layer_of(target)
            if target_level > level or (target_level == level and target_unit != unit and level != 0):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


# The command-line dispatcher reaches the benchmark commands (imported only when one runs); nothing else outside the
# benchmarks may import them.
BENCH_DISPATCH = {"mini_infer.entrypoints.cli"}


def test_the_runtime_imports_nothing_of_the_benchmarks():
    """What `mini-infer serve`, `generate` and `LLM` import never reaches mini_infer.bench (nor its extra's
    matplotlib): read from the sources, and seen in a process that loads the server and builds the command line."""
    reaching = [f"{module} -> {target}" for module, targets in sorted(import_graph().items())
                if not module.startswith("mini_infer.bench") and module not in BENCH_DISPATCH
                for target in sorted(targets) if target.startswith("mini_infer.bench")]
    assert not reaching, "runtime modules that import the benchmarks:\n" + "\n".join(reaching)
    script = ("import sys; from mini_infer import LLM; from mini_infer.entrypoints.openai import api_server; "
              "from mini_infer.entrypoints import cli; cli._build_parser(); "
              "print(sorted(m for m in sys.modules if m.startswith(('mini_infer.bench', 'matplotlib'))))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "modules that import each other in a circle: " + " -> ".join(cycle)


def test_no_package_import_cycles():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        unit = layer_of(module)[1]
        packages.setdefault(unit, set()).update(layer_of(t)[1] for t in targets if layer_of(t)[1] != unit)
    cycle = find_cycle(packages)
    assert cycle is None, "packages that import each other in a circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"a"}}, ["a", "a"]),
])
def test_find_cycle(graph, expected):
    assert find_cycle(graph) == expected


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import both count."""
    package = tmp_path / "mini_infer"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "a.py").write_text("def f():\n    from mini_infer.entrypoints import cli\n")
    (package / "engine" / "b.py").write_text("from . import a\nfrom .a import f\n")
    (package / "entrypoints").mkdir()
    (package / "entrypoints" / "__init__.py").write_text("")
    (package / "entrypoints" / "cli.py").write_text("")
    graph = import_graph(package)
    assert graph["mini_infer.engine.a"] == {"mini_infer.entrypoints.cli"}
    assert graph["mini_infer.engine.b"] == {"mini_infer.engine.a"}
