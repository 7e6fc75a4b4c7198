"""Fixtures of the deploy tests: a working helm or a skip that says why there is none."""

from __future__ import annotations

import pytest

from tests.deploy import chart


@pytest.fixture(scope="session")
def helm() -> str:
    binary, reason = chart.install_helm()
    if binary is None:
        pytest.skip(f"helm could not be installed by scripts/get_helm.sh: {reason}")
    return binary
