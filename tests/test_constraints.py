"""The test and benchmark tools are pinned (``constraints/test.txt``), so a new machine gets
the versions CI passed with instead of whatever was released last."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not an exact pin (name==version)"
            pins[_name(name)] = version
    return pins


def test_every_test_and_bench_tool_is_pinned():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pinned = _pins(ROOT / "constraints" / "test.txt") | _pins(ROOT / "constraints" / "cpu.txt")
    wanted = {_name(r) for extra in ("test", "bench") for r in extras[extra]}
    assert {"pytest", "pytest-xdist", "pytest-timeout"} <= wanted
    assert sorted(wanted - pinned.keys()) == []


def test_make_test_installs_with_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    test_deps = makefile.split("test-deps:", 1)[1].split("\n\n", 1)[0]
    assert "constraints/test.txt" in makefile and "$(TOOL_CONSTRAINTS)" in test_deps
