"""Who served a request is not told to clients unless the operator asks: the
headers reveal the cluster's layout and which replica holds which prefix."""

from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.ingress import INGRESS_HEADER, REPLICA_HEADER, replica_headers


def test_no_replica_headers_by_default():
    assert replica_headers(ClusterConfig(), "r1", "i1") == {}


def test_headers_when_exposed():
    cluster = ClusterConfig(expose_replica_headers=True)
    assert replica_headers(cluster, "r1,r2", "i1") == {
        REPLICA_HEADER: "r1,r2",
        INGRESS_HEADER: "i1",
    }


def test_flag_and_validation(capsys):
    with pytest.raises(ValueError, match="expose_replica_headers"):
        ClusterConfig(expose_replica_headers="yes")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--expose-replica-headers" in capsys.readouterr().out
