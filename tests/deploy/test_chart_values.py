"""Renderings users rely on: TP size -> bundles and GPU limits, Redis wiring, API-key Secret,
and a serveConfigV2 whose args build the application's configs."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from tests.deploy import chart

pytestmark = pytest.mark.usefixtures("helm")


def _groups(docs) -> dict[str, dict]:
    cluster = chart.only(docs, "RayService")["spec"]["rayClusterConfig"]
    return {group["groupName"]: group for group in cluster["workerGroupSpecs"]}


def _engine_deployment(docs) -> dict:
    (app,) = chart.serve_config(docs)["applications"]
    (deployment,) = app["deployments"]
    return deployment


def _all_containers(docs) -> list[dict]:
    cluster = chart.only(docs, "RayService")["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def _env(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def _api_key_secrets(docs) -> list[dict]:
    """The API-key Secrets (the in-cluster Redis's password Secret aside)."""
    return [
        s for s in chart.by_kind(docs, "Secret") if not s["metadata"]["name"].endswith("-redis")
    ]


@pytest.mark.parametrize(("tp_size", "gpus_per_pod"), [(1, 1), (2, 2), (2, 4), (4, 8)])
def test_tensor_parallel_size_sets_bundles_and_gpu_limits(tp_size, gpus_per_pod) -> None:
    docs = chart.render(
        values={
            "engine": {"tensorParallelSize": tp_size},
            "gpuWorkers": {"gpusPerPod": gpus_per_pod},
        }
    )
    deployment = _engine_deployment(docs)
    assert deployment["placement_group_strategy"] == "STRICT_PACK"
    assert [b["GPU"] for b in deployment["placement_group_bundles"]] == [1] * tp_size
    group = _groups(docs)["gpu"]
    assert group["rayStartParams"]["num-gpus"] == str(gpus_per_pod)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus_per_pod)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus_per_pod)
    # Whole replicas fit in a pod: its GPUs are a multiple of the bundles one replica needs.
    assert gpus_per_pod % len(deployment["placement_group_bundles"]) == 0
    args = chart.serve_config(docs)["applications"][0]["args"]
    assert args["engine"].get("tensor_parallel_size", 1) == tp_size
    assert args["cluster"]["num_gpus_per_replica"] == 1


def test_head_runs_no_replicas_by_default() -> None:
    docs = chart.render()
    head = chart.only(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_cpu_variant_has_no_gpus_anywhere() -> None:
    docs = chart.render([chart.CHART_DIR / "ci" / "cpu-values.yaml"])
    assert set(_groups(docs)) == {"cpu"}
    assert _groups(docs)["cpu"]["rayStartParams"]["num-gpus"] == "0"
    for container in _all_containers(docs):
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "GPU" not in _engine_deployment(docs)["placement_group_bundles"][0]
    args = chart.serve_config(docs)["applications"][0]["args"]
    assert args["engine"]["device"] == "cpu"
    assert args["router"]["index_backend"] == "embedded"
    assert not chart.by_kind(docs, "StatefulSet")


def test_in_cluster_redis_is_wired_into_the_router() -> None:
    docs = chart.render()
    statefulset = chart.only(docs, "StatefulSet")
    service = chart.only(docs, "Service")
    assert (
        service["spec"]["selector"].items()
        <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    )
    args = chart.serve_config(docs)["applications"][0]["args"]
    assert args["router"]["index_backend"] == "redis"
    port = service["spec"]["ports"][0]["port"]
    expected = f"redis://{service['metadata']['name']}.{chart.NAMESPACE}.svc:{port}/0"
    assert args["router"]["redis_url"] == expected


def test_external_redis_replaces_the_statefulset_and_wires_url_and_password() -> None:
    docs = chart.render([chart.CHART_DIR / "ci" / "external-redis-values.yaml"])
    assert not chart.by_kind(docs, "StatefulSet")
    assert not chart.by_kind(docs, "Service")
    args = chart.serve_config(docs)["applications"][0]["args"]
    assert args["router"]["index_backend"] == "redis"
    assert args["router"]["redis_url"] == "redis://redis-master.infra.svc:6379/3"
    for container in _all_containers(docs):
        ref = _env(container)["PREFIXSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "redis-auth", "key": "password"}


def test_api_key_reaches_every_ray_container_from_the_secret_only() -> None:
    docs = chart.render(values={"apiKey": {"enabled": True, "value": "sk-test-123"}})
    (secret,) = _api_key_secrets(docs)
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "sk-test-123"
    for container in _all_containers(docs):
        ref = _env(container)["PREFIXSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    rayservice_text = str(chart.only(docs, "RayService"))
    assert "sk-test-123" not in rayservice_text


def test_existing_api_key_secret_is_referenced_not_created() -> None:
    docs = chart.render([chart.CHART_DIR / "ci" / "tp2-autoscaling-values.yaml"])
    assert not _api_key_secrets(docs)
    for container in _all_containers(docs):
        ref = _env(container)["PREFIXSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "prefixserve-keys", "key": "token"}


def test_no_api_key_env_unless_enabled() -> None:
    docs = chart.render()
    assert not _api_key_secrets(docs)
    assert all("PREFIXSERVE_API_KEY" not in _env(c) for c in _all_containers(docs))


@pytest.mark.parametrize(("transport", "proxy_grpc"), [("grpc", "1"), ("ray", "0")])
def test_handle_transport_sets_the_proxy_transport_in_every_ray_container(
    transport, proxy_grpc
) -> None:
    docs = chart.render(values={"cluster": {"handleTransport": transport}})
    for container in _all_containers(docs):
        assert _env(container)["RAY_SERVE_PROXY_USE_GRPC"]["value"] == proxy_grpc
    (app,) = chart.serve_config(docs)["applications"]
    assert app["args"]["cluster"]["handle_transport"] == transport


def test_every_ray_container_sets_serves_controller_and_metrics_as_the_deployments_do() -> None:
    """The controller and proxy read these from the container's environment, not from a
    deployment's runtime_env."""
    from cluster.app import SERVE_ENV

    for container in _all_containers(chart.render()):
        for name in ("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"):
            assert _env(container)[name]["value"] == SERVE_ENV[name]


def test_model_cache_claim_is_mounted_everywhere() -> None:
    docs = chart.render(values={"modelCache": {"enabled": True, "accessModes": ["ReadWriteMany"]}})
    claim = chart.only(docs, "PersistentVolumeClaim")["metadata"]["name"]
    cluster = chart.only(docs, "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == claim
    args = chart.serve_config(docs)["applications"][0]["args"]
    assert args["engine"]["cache_dir"] == "/models"


def test_autoscaling_replaces_fixed_replicas() -> None:
    docs = chart.render([chart.CHART_DIR / "ci" / "tp2-autoscaling-values.yaml"])
    deployment = _engine_deployment(docs)
    assert deployment["num_replicas"] == "auto"
    assert deployment["autoscaling_config"]["min_replicas"] == 2
    assert deployment["autoscaling_config"]["max_replicas"] == 6
    assert chart.only(docs, "RayService")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]


def test_keda_scaled_object_queries_waiting_requests() -> None:
    docs = chart.render([chart.CHART_DIR / "ci" / "keda-values.yaml"])
    scaled = chart.only(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "gpu-overprovisioner"
    (trigger,) = scaled["spec"]["triggers"]
    assert "prefixserve:num_requests_waiting" in trigger["metadata"]["query"]


@pytest.mark.parametrize(
    "values_file",
    [None, *chart.CI_VALUES_FILES],
    ids=lambda p: getattr(p, "stem", "default"),
)
def test_serve_config_args_build_the_application_configs(values_file) -> None:
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ClusterConfig, configs_from_args
    from router.config import RouterConfig
    from worker.config import EngineConfig

    docs = chart.render([] if values_file is None else [values_file])
    config = chart.serve_config(docs)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    args = app["args"]
    engine = EngineConfig(**args["engine"])
    router = RouterConfig(**args["router"])
    cluster = ClusterConfig(**args["cluster"])
    assert configs_from_args(args) == (engine, cluster, router)
    assert router.block_size == engine.block_size
    assert cluster.app_name == app["name"]
    assert isinstance(engine.kv_cache_bytes, (int, type(None)))


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8", "fp8_e4m3"])
def test_kv_cache_dtype_reaches_the_engine_config(kv_cache_dtype) -> None:
    from worker.config import EngineConfig

    values = {} if kv_cache_dtype is None else {"engine": {"kvCacheDtype": kv_cache_dtype}}
    (app,) = chart.serve_config(chart.render(values=values))["applications"]
    engine = EngineConfig(**app["args"]["engine"])
    assert engine.kv_cache_dtype == (kv_cache_dtype or "auto")


def test_lora_values_reach_the_engine_config() -> None:
    """Both forms of loraModules (vLLM's name/path objects and name=path strings) and the
    slot knobs arrive in EngineConfig; an entry of neither form fails the schema."""
    from worker.config import EngineConfig

    values = {
        "engine": {
            "loraModules": [{"name": "sql", "path": "/models/sql"}, "chat=/models/chat"],
            "maxLoras": 2,
            "maxLoraRank": 64,
        }
    }
    (app,) = chart.serve_config(chart.render(values=values))["applications"]
    engine = EngineConfig(**app["args"]["engine"])
    assert engine.lora_modules == (("sql", "/models/sql"), ("chat", "/models/chat"))
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 64)
    (app,) = chart.serve_config(chart.render())["applications"]
    assert not EngineConfig(**app["args"]["engine"]).enable_lora
    with pytest.raises(chart.HelmError):
        chart.render(values={"engine": {"loraModules": ["no-path"]}})


def test_deployment_options_name_a_deployment_of_the_built_application() -> None:
    """Serve rejects options for a deployment the builder does not create."""
    from ray.serve._private.build_app import build_app as build_deployments

    from cluster.app import build_app

    config = chart.serve_config(chart.render([chart.CHART_DIR / "ci" / "cpu-values.yaml"]))
    (app,) = config["applications"]
    built = build_deployments(build_app(app["args"]), name=app["name"])
    names = {deployment.name for deployment in built.deployments}
    for options in app["deployments"]:
        assert options["name"] in names


# Fields the chart sets itself (from other values or the cluster layout) or never sets.
CHART_DERIVED_FIELDS = {
    # claim_cpus: the application sets it from cluster.engineCpuAffinity and numCpusPerReplica.
    "engine": {"cache_dir", "tensor_parallel_size", "download_dir", "claim_cpus"},
    "router": {"block_size", "index_backend", "redis_url"},
    "cluster": {"num_gpus_per_replica", "app_name", "host", "port", "ray_address", "api_key",
                # The chart's Service targets Serve's proxy; each ingress replica's own port
                # (direct ingress) is not something a Kubernetes Service can name.
                "direct_ingress"},
}  # fmt: skip


def test_values_reach_every_config_field() -> None:
    """A field added to a config dataclass needs a chart value (or a reason it has none)."""
    import yaml

    from cluster.config import ClusterConfig
    from router.config import RouterConfig
    from worker.config import EngineConfig

    values = yaml.safe_load((chart.CHART_DIR / "values.yaml").read_text())
    for section, cls in (
        ("engine", EngineConfig),
        ("router", RouterConfig),
        ("cluster", ClusterConfig),
    ):
        snake = {
            "".join(f"_{c.lower()}" if c.isupper() else c for c in key) for key in values[section]
        }
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - snake - CHART_DERIVED_FIELDS[section]
        assert not missing, f"values.yaml {section} has no value for {sorted(missing)}"
        unknown = snake - fields - {"tensor_parallel_size"}
        assert not unknown, f"values.yaml {section} sets unknown fields {sorted(unknown)}"
