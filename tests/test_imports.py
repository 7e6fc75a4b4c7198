"""docs/design.md's import directions: worker -> kernels and router.protocol; router -> router;
kernels -> torch/triton; cluster and bench -> anything. Walks every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"cluster", "worker", "router", "kernels", "bench"}
ALLOWED = {
    "worker": {"worker", "kernels", "router.protocol"},
    "router": {"router"},
    "kernels": {"kernels"},
}
FORBIDDEN_THIRD_PARTY = {
    "router": {"torch", "triton"},
    "kernels": {"ray", "redis", "fastapi"},
    "worker": {"ray", "redis"},
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _allowed(pkg: str, name: str) -> bool:
    top = name.split(".")[0]
    if top not in PACKAGES:
        return top not in FORBIDDEN_THIRD_PARTY.get(pkg, set())
    if pkg not in ALLOWED:
        return True
    return any(
        name == a or name.startswith(a + ".") or (a == top and "." not in a) for a in ALLOWED[pkg]
    )


def test_import_directions():
    bad = []
    for pkg in ALLOWED:
        for path in (ROOT / pkg).rglob("*.py"):
            bad += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in _imports(path)
                if not _allowed(pkg, n)
            ]
    assert not bad, "imports against docs/design.md:\n" + "\n".join(bad)


def test_the_checker_catches_a_bad_edge():
    assert not _allowed("worker", "router.policy")
    assert not _allowed("router", "worker.engine")
    assert not _allowed("router", "torch")
    assert _allowed("worker", "router.protocol")
    assert _allowed("cluster", "worker.engine")


def test_an_engine_replica_loads_no_torch_until_it_needs_it():
    """The engine runs in its own process; the Ray actor that relays its tokens (and an
    ``AsyncEngine`` around a process core) import neither torch nor transformers, which would
    cost each replica ~220 MB. Torch loads there only with tensor parallelism (the engine in a
    thread) or for a KV pull's payload."""
    import subprocess
    import sys

    code = (
        "import sys, cluster.replica, worker.async_engine, worker.loader, cluster.ingress; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
