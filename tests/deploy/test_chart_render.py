"""The chart lints and renders valid manifests with its defaults and every ci/ values file."""

from __future__ import annotations

import copy

import pytest

from tests.deploy import chart

pytestmark = pytest.mark.usefixtures("helm")

VALUES_CASES = [None, *chart.CI_VALUES_FILES]


def _case_id(path) -> str:
    return "default" if path is None else path.stem


@pytest.mark.parametrize("values_file", VALUES_CASES, ids=_case_id)
def test_lint_and_render_validate(values_file) -> None:
    files = [] if values_file is None else [values_file]
    chart.lint(files)
    docs = chart.render(files)
    assert chart.by_kind(docs, "RayService"), "no RayService rendered"
    for doc in docs:
        chart.validate_manifest(doc)
    names = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(names) == len(set(names)), f"duplicate resources: {names}"


def test_ci_values_files_exist() -> None:
    assert len(chart.CI_VALUES_FILES) >= 3


def test_crd_validation_rejects_a_misspelt_field() -> None:
    """The strict KubeRay schema catches what a real API server would silently prune."""
    docs = chart.render()
    rayservice = copy.deepcopy(chart.only(docs, "RayService"))
    chart.validate_manifest(rayservice)
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(ValueError, match="rayStartParam"):
        chart.validate_manifest(rayservice)


def test_core_validation_rejects_a_misspelt_field() -> None:
    import kubernetes_validate

    docs = chart.render()
    statefulset = copy.deepcopy(chart.only(docs, "StatefulSet"))
    chart.validate_manifest(statefulset)
    statefulset["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="envv"):
        chart.validate_manifest(statefulset)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"blcokSize": 16}}, "blcokSize"),
        ({"engine": {"tensorParallelSize": 0}}, "tensorParallelSize"),
        ({"engine": {"kvCacheDtype": "int4"}}, "kvCacheDtype"),
        ({"router": {"policy": "random"}}, "policy"),
        ({"gpuWorkers": {"gpu": 2}}, "gpu"),
        ({"redis": {"external": {"url": "http://redis:6379"}}}, "url"),
        # Removed: KubeRay ignores these since v1.1 (ray-project/kuberay#1685).
        (
            {"serve": {"deploymentUnhealthySecondThreshold": 900}},
            "deploymentUnhealthySecondThreshold",
        ),
        ({"serve": {"upgradeStrategy": {"type": "Rolling"}}}, "type"),
        ({"modelCache": {"accessModes": ["ReadWriteAll"]}}, "accessModes"),
        ({"extraArgs": {"engin": {}}}, "engin"),
    ],
)
def test_values_schema_rejects_typos_and_bad_values(values, message) -> None:
    with pytest.raises(chart.HelmError, match=message):
        chart.render(values=values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"tensorParallelSize": 2}, "gpuWorkers": {"gpusPerPod": 3}}, "multiple"),
        ({"gpuWorkers": {"enabled": False}}, "no pod has a GPU"),
        ({"engine": {"device": "cpu"}}, "cpuWorkers.enabled"),
        ({"apiKey": {"enabled": True}}, "apiKey"),
        ({"keda": {"enabled": True}}, "scaleTargetRef"),
        (
            {"keda": {"enabled": True, "scaleTargetRef": {"kind": "Deployment", "name": "x"}}},
            "serviceMonitor",
        ),
        ({"gcsFaultTolerance": {"enabled": True}, "redis": {"enabled": False}}, "needs a Redis"),
        (
            {"serve": {"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}}},
            "clusterUpgradeOptions",
        ),
        (
            {
                "serve": {
                    "upgradeStrategy": {
                        "type": "NewClusterWithIncrementalUpgrade",
                        "clusterUpgradeOptions": {
                            "gatewayClassName": "istio",
                            "stepSizePercent": 25,
                            "intervalSeconds": 60,
                        },
                    }
                }
            },
            "autoscaling.enabled",
        ),
        ({"httpRoute": {"enabled": True}}, "parentRefs"),
        (
            {
                "ingress": {"enabled": True},
                "httpRoute": {"enabled": True, "parentRefs": [{"name": "g"}]},
            },
            "only one",
        ),
        ({"extraArgs": {"engine": {"maxModelLen": 4096}}}, "max_model_len"),
    ],
)
def test_inconsistent_values_fail_rendering(values, message) -> None:
    with pytest.raises(chart.HelmError, match=message):
        chart.render(values=values)
