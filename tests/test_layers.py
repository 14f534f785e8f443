"""The layers hold (docs/architecture.md): the engine does not import Prefect, and the package's
module-level imports form no cycle (issue 13: "The import graph has no cycle")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prefect_nemo"
ENGINE = [
    "prefect_nemo.jobs",
    "prefect_nemo.errors",
    "prefect_nemo.names",
    "prefect_nemo.lifecycle",
    "prefect_nemo.watcher",
    "prefect_nemo.logs",
    "prefect_nemo.log_files",
    "prefect_nemo.report",
    "prefect_nemo.progress",
    "prefect_nemo.kube",
    "prefect_nemo.packaging",
    "prefect_nemo.placement",
    "prefect_nemo.placement.replicas",
    "prefect_nemo.backends.ray_jobs",
    "prefect_nemo.backends.kuberay",
    "prefect_nemo.backends.kubeflow",
    "prefect_nemo.backends.dynamo",
    "prefect_nemo.backends.nemo_run",
    "prefect_nemo.doctor",
]


def test_the_engine_imports_without_prefect() -> None:
    """"The engine layer (jobs, lifecycle, watcher, placement, packaging, kube, backends) is free
    of Prefect, as designed, and that should stay." """
    code = (
        "import importlib, sys\n"
        f"for name in {ENGINE!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'prefect' not in sys.modules, f'{name} imports Prefect'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """prefect_nemo modules a file imports, at module level or inside functions (an import
    deferred into a function to dodge a cycle is still a cycle); TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def test_the_package_has_no_import_cycle() -> None:
    """"The import graph has no cycle (today placement/groups.py <-> placement/process.py)". """
    files = [p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts]
    known = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, known) - {_module_name(p)} for p in files}
    # a package's __init__ that re-exports its submodules is not a dependency of them
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
