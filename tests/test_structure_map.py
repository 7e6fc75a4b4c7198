"""docs/structure.md stays true: every source file has a line in it, and every path it names exists.

A map line is a top-level bullet that starts with a backticked path: ``- `worker/engine.py` — ...``.
A line naming a folder (``- `bench/serve/` — ...``) covers every file under it, for packages the
map describes as one unit. Reads files only: no package is imported, so this runs in
milliseconds and fails the same way whatever is installed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "structure.md"
PACKAGES = ("cluster", "worker", "router", "kernels", "bench")
SKIPPED_FOLDERS = ("bench/results/",)  # benchmark output, not code
SKIPPED_NAMES = {"__init__.py"}  # package markers; each package has its own paragraph instead
# Paths the reverse check verifies: backticked, relative to the repo root, starting in one of
# these folders (a token such as `.tools/` or `attention.py` in a table is not a repo path).
CHECKED_ROOTS = (*PACKAGES, "deploy", "scripts", "tests", "docs")

MAP_LINE = re.compile(r"^- `([^`\s]+)`")
BACKTICKED = re.compile(r"`([^`\s]+)`")
PATH_TOKEN = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")  # no globs, placeholders, URLs or spaces


def source_files(root: Path = ROOT) -> list[str]:
    """Repo-relative paths of the ``.py`` files the map must name."""
    found = []
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if path.name in SKIPPED_NAMES or rel.startswith(SKIPPED_FOLDERS):
                continue
            found.append(rel)
    return sorted(found)


def map_entries(text: str) -> list[str]:
    """The paths of the map's lines, in order (a path listed twice appears twice)."""
    return [m.group(1) for line in text.splitlines() if (m := MAP_LINE.match(line))]


def unmapped(files: list[str], entries: list[str]) -> list[str]:
    named = set(entries)
    folders = tuple(e for e in named if e.endswith("/"))
    return [f for f in files if f not in named and not f.startswith(folders)]


def named_paths(text: str) -> set[str]:
    """Every backticked repo path in the text: ``.py``/``.sh`` files and folders."""
    paths = set()
    for token in BACKTICKED.findall(text):
        if not PATH_TOKEN.match(token) or "/" not in token:
            continue
        if token.split("/", 1)[0] not in CHECKED_ROOTS:
            continue
        if token.endswith(("/", ".py", ".sh")) or "." in token.rsplit("/", 1)[-1]:
            paths.add(token)
    return paths


def missing_paths(paths: set[str], root: Path = ROOT) -> list[str]:
    return sorted(
        p for p in paths if not (root / p).exists() or (p.endswith("/") and not (root / p).is_dir())
    )


def test_every_source_file_has_a_line_in_the_map():
    missing = unmapped(source_files(), map_entries(MAP.read_text()))
    assert not missing, (
        "files that docs/structure.md does not name; add a line for each under its package, "
        "'- `path` — what it owns' (and, where it could be confused with another file, how "
        "they differ):\n  " + "\n  ".join(missing)
    )


def test_every_path_the_map_names_exists():
    gone = missing_paths(named_paths(MAP.read_text()))
    assert not gone, (
        "docs/structure.md names paths that do not exist (deleted or renamed?); fix or drop "
        "their lines:\n  " + "\n  ".join(gone)
    )


def test_each_file_has_one_line():
    entries = map_entries(MAP.read_text())
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, "docs/structure.md has more than one line for: " + ", ".join(twice)


def test_the_checks_catch_a_missing_line_and_a_stale_one(tmp_path):
    text = (
        "- `worker/engine.py` — the engine\n"
        "- `bench/serve/` — a package named as one unit\n"
        "  - `worker/indented.py` is prose, not a map line\n"
        "The walk mentions `worker/sampler.py` in prose only.\n"
        "A glob `kernels/triton_*.py`, a placeholder `bench/results/<date>.json`, `.tools/`.\n"
    )
    files = ["worker/engine.py", "worker/sampler.py", "bench/serve/cli.py", "worker/indented.py"]
    assert unmapped(files, map_entries(text)) == ["worker/sampler.py", "worker/indented.py"]

    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "engine.py").write_text("")
    (tmp_path / "worker" / "__init__.py").write_text("")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run.py").write_text("")
    assert source_files(tmp_path) == ["worker/engine.py"]
    assert named_paths(text) == {
        "worker/engine.py",
        "bench/serve/",
        "worker/indented.py",
        "worker/sampler.py",
    }
    assert missing_paths(named_paths(text), tmp_path) == [
        "bench/serve/",
        "worker/indented.py",
        "worker/sampler.py",
    ]
