"""Every test module that starts Ray is in the ``ray`` xdist group (``tests/conftest.py``).

``make test`` runs two pytest-xdist workers; a Ray-starting module left outside the group
could run its cluster beside another one. This reads each test module's source for the calls
that start Ray (``ray.init``, ``serve.run``, the shared cluster fixtures, ``ray start``,
``prefixserve serve`` as a subprocess) and fails naming any such module that
``is_ray_test`` leaves out.
"""

from __future__ import annotations

import re

from tests.conftest import TESTS_DIR, is_ray_test

STARTS_RAY = re.compile(
    r"ray\.init\(|serve\.run\(|start_cluster\(|start_tiny_cluster\(|"
    r"\"start\",\s*\"--head\"|\"cluster\.cli\",\s*\"serve\"|\(\),\s*\"serve\""
)


HELPERS = ("test_xdist_groups.py", "cluster/conftest.py")
"""This module, and the one that defines ``start_cluster`` (its callers are what the pattern
catches)."""


def test_every_module_that_starts_ray_is_in_the_ray_group():
    starting = [
        path
        for path in sorted(TESTS_DIR.rglob("*.py"))
        if not path.as_posix().endswith(HELPERS) and STARTS_RAY.search(path.read_text())
    ]
    assert len(starting) >= 5, starting  # the pattern still finds the known ones
    outside = [str(p.relative_to(TESTS_DIR)) for p in starting if not is_ray_test(p)]
    assert outside == [], f"start Ray outside tests/conftest.py's RAY_TEST_PATHS: {outside}"


def test_unit_tests_stay_outside_the_ray_group():
    assert not is_ray_test(TESTS_DIR / "kernels" / "test_cpu_kernels.py")
    assert not is_ray_test(TESTS_DIR / "worker" / "test_determinism.py")
    assert not is_ray_test(TESTS_DIR / "cluster" / "test_responses.py")  # no Ray in it
    assert is_ray_test(TESTS_DIR / "cluster" / "tiny" / "test_batch.py")
    assert is_ray_test(TESTS_DIR / "e2e" / "test_ray_job.py")


def test_xdist_sees_the_group_in_the_node_ids():
    """Under ``-n 2 --dist loadgroup`` a Ray test's node id carries ``@ray`` (xdist reads the
    marks in its own collection hook, so ours must run before it)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
         "loadgroup", "-v", "tests/cluster/test_prefix_routing.py", "-k",
         "router_metrics or drains_once"],
        cwd=TESTS_DIR.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert passed, result.stdout[-2000:] + result.stderr[-2000:]
    assert all(line.rstrip().endswith("@ray") for line in passed), passed
