"""No import cycle between the modules of one package (kernels/, router/).

Walks every import statement with ``ast`` (nothing is imported), lazy ones inside functions
included: a lazy import only postpones a cycle to the first call. Shared helpers and types go
to a module both sides import (``kernels/triton_common.py``, ``router/index_types.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "router")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, package: str, modules: set[str]) -> set[str]:
    """Modules of ``package`` (in ``modules``) that ``path`` imports."""
    this = _module_name(path)
    base = this if path.name == "__init__.py" else this.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                module = ".".join(parent + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # from pkg import mod
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != package and name != this:
            found.add(name)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    paths = sorted((ROOT / package).rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imported(p, package, modules) for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_inside_a_package():
    bad = [
        f"{package}: {' <-> '.join(cycle)}"
        for package in PACKAGES
        for cycle in _cycles(_graph(package))
    ]
    assert not bad, (
        "import cycles (move the shared part to a module both sides import):\n" + "\n".join(bad)
    )


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph = _graph("router")
    assert "router.index_types" in graph["router.embedded_index"]
    assert "router.embedded_index" in graph["router.index"]  # lazy imports count
