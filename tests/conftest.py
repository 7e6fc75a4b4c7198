"""Shared fixtures: the bundled model (converted once per machine), tiny random models, and
the per-test seed; and which tests share one pytest-xdist worker.

Every test runs with Python's ``random``, numpy's global generator and torch seeded from one
fresh seed (``test_seed``); tests that build their own generators derive them from it. A
failing test's report names the seed, and ``PREFIXSERVE_TEST_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

SEED_ENV = "PREFIXSERVE_TEST_SEED"

# Two cores on CI: one intra-op thread per test process keeps timings sane when Ray or a
# second process runs beside the test.
torch.set_num_threads(int(os.environ.get("PREFIXSERVE_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from worker.loader import resolve_model

    return resolve_model("smollm2").path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_path) -> dict[str, str]:
    """Folders of tiny random-weight models, one per supported architecture."""
    from worker.testing import TINY_ARCHS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    models = {arch: make_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(TINY_ARCHS)}
    models["llama3-scaled"] = make_tiny_model(
        root / "llama3",
        "llama",
        seed=7,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return models


@pytest.fixture(autouse=True)
def test_seed(request) -> int:
    """This test's seed (``PREFIXSERVE_TEST_SEED``, or fresh from the OS); seeds the globals."""
    seed = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says how to replay it."""
    outcome = yield
    report = outcome.get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("seed", f"replay with {SEED_ENV}={seed}"))


TESTS_DIR = Path(__file__).resolve().parent
RAY_TEST_PATHS = (
    "chaos/test_faults.py",
    "cluster/tiny/",
    "cluster/test_kv_pull_serve.py",
    "cluster/test_prefix_routing.py",
    "cluster/test_tp_health.py",
    "e2e/",
)
"""Tests (folders and modules, relative to tests/) that start Ray, a Serve app or a
``prefixserve serve`` process. ``make test`` runs the suite on two pytest-xdist workers
(``-n 2 --dist loadgroup``); these all go to one of them, in turn, so at most one Ray cluster
runs at a time (two would fight over Ray's system processes, whose priority
``cluster/priority.py`` sets by name, and over a 2-core machine's time), and a folder's shared
cluster (tests/cluster/tiny) starts once. The other worker takes everything else: the kernels,
the engine, the router, the charts, the cluster's parts tested in one process (the ingress's
response building, a replica without Serve), which spend CPU where the Ray tests mostly wait
for processes to start, fail over and drain. ``tests/test_xdist_groups.py`` fails on a module
that starts Ray outside this list."""


def is_ray_test(path: Path) -> bool:
    try:
        relative = path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return False
    return relative.startswith(RAY_TEST_PATHS)


def pytest_itemcollected(item):
    """Puts every Ray test in the ``ray`` xdist group (a no-op marker without xdist).

    Marked as each item is collected, which pytest does before any
    ``pytest_collection_modifyitems`` hook runs, so xdist (which turns the group marks into
    ``@ray`` node ids in its own ``modifyitems``) sees the mark whatever order pytest calls
    the plugins' ``modifyitems`` in: under pytest 9.2 a ``tryfirst`` conftest hook there ran
    after xdist's, and no test was grouped."""
    if is_ray_test(Path(str(item.path))):
        item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Stops the run when xdist's ``loadgroup`` left a Ray test outside its group.

    xdist applies a group by renaming the item (``item._nodeid += "@ray"``); pytest 9.2 keeps
    node ids elsewhere (``Node._id``), so with pytest-xdist 3.8 the rename is lost and every
    Ray test could run on both workers at once. ``constraints/test.txt`` pins a pair that
    works; this says so as soon as a worker has collected, instead of letting two Ray
    clusters fight."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    root = Path(str(node.config.rootpath))
    lost = [i for i in ids if is_ray_test(root / i.split("::")[0]) and not i.endswith("@ray")]
    if lost:
        pytest.exit(
            f"pytest-xdist did not put {len(lost)} Ray tests in the 'ray' group (first: "
            f"{lost[0]}) under pytest {pytest.__version__}; install the test tools pinned in "
            "constraints/test.txt (make test-deps)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
