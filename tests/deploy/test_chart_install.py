"""What a first `helm install` on a stock cluster depends on: a claim that binds (or none), the
image's Ray equal to `rayVersion`, the model reaching the pods (hub download, HF token, the
cache volume), the password-protected and fenced-off Redis, GCS fault tolerance, the upgrade
strategy, and the optional Ingress/HTTPRoute, ServiceAccount, PodDisruptionBudget, security
contexts, extra volumes and extra Serve args."""

from __future__ import annotations

import base64
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy import chart

pytestmark = pytest.mark.usefixtures("helm")

CI = chart.CHART_DIR / "ci"
HUB_VALUES = CI / "hub-model-values.yaml"
INCREMENTAL_VALUES = CI / "incremental-upgrade-httproute-values.yaml"


def _cluster(docs) -> dict:
    return chart.only(docs, "RayService")["spec"]["rayClusterConfig"]


def _pod_specs(docs) -> dict[str, dict]:
    """Pod spec per component label (ray-head, ray-worker-gpu, ...)."""
    cluster = _cluster(docs)
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster.get("workerGroupSpecs", [])]
    return {t["metadata"]["labels"]["app.kubernetes.io/component"]: t for t in templates}


def _env(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def _args(docs) -> dict:
    return chart.serve_config(docs)["applications"][0]["args"]


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels + In expressions) against pod labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_default_install_needs_no_rwx_storage_and_no_removed_kuberay_fields() -> None:
    docs = chart.render()
    # No claim by default (an emptyDir per pod); when enabled, ReadWriteOnce, which any
    # default storage class binds (ReadWriteMany stays Pending on most clusters).
    assert not chart.by_kind(docs, "PersistentVolumeClaim")
    for template in _pod_specs(docs).values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert "emptyDir" in volumes["model-cache"]
    claim = chart.only(
        chart.render(values={"modelCache": {"enabled": True}}), "PersistentVolumeClaim"
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    spec = chart.only(docs, "RayService")["spec"]
    assert "deploymentUnhealthySecondThreshold" not in spec
    assert "serviceUnhealthySecondThreshold" not in spec
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    values_text = (chart.CHART_DIR / "values.yaml").read_text()
    assert "UnhealthySecondThreshold" not in values_text


def test_image_ray_version_equals_ray_version() -> None:
    """KubeRay and the head/worker handshake need the image's Ray to be `rayVersion`."""
    values = yaml.safe_load((chart.CHART_DIR / "values.yaml").read_text())
    docs = chart.render()
    assert _cluster(docs)["rayVersion"] == values["rayVersion"]
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (chart.REPO_ROOT / "deploy" / "docker" / name).read_text()
        (pinned,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", text, flags=re.M)
        assert pinned == values["rayVersion"], f"deploy/docker/{name} pins Ray {pinned}"
        assert '"ray[serve]==${RAY_VERSION}"' in text, (
            f"deploy/docker/{name} must install RAY_VERSION"
        )


def test_in_cluster_redis_has_a_password_from_a_secret_and_a_network_policy() -> None:
    docs = chart.render()
    secret = chart.only(docs, "Secret")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 32
    assert password not in str(chart.only(docs, "RayService"))
    (redis,) = chart.only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    for name in (
        "REDIS_PASSWORD",
        "REDISCLI_AUTH",
    ):  # REDISCLI_AUTH: the liveness probe's redis-cli
        ref = _env(redis)[name]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    for template in _pod_specs(docs).values():
        for container in template["spec"]["containers"]:
            ref = _env(container)["PREFIXSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    # The policy fences the Redis pod and lets every Ray pod of this release in.
    policy = chart.only(docs, "NetworkPolicy")["spec"]
    redis_labels = chart.only(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["podSelector"], redis_labels)
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    for component, template in _pod_specs(docs).items():
        assert _selects(peer["podSelector"], template["metadata"]["labels"]), component
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    # An existing Secret is referenced, not created; auth off leaves no password anywhere.
    docs = chart.render(
        values={"redis": {"auth": {"existingSecret": "my-redis", "secretKey": "pw"}}}
    )
    assert not chart.by_kind(docs, "Secret")
    (redis,) = chart.only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert _env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "my-redis",
        "key": "pw",
    }
    docs = chart.render(values={"redis": {"auth": {"enabled": False}}})
    assert (
        "--requirepass"
        not in chart.only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert "PREFIXSERVE_REDIS_PASSWORD" not in str(chart.only(docs, "RayService"))


def test_gcs_fault_tolerance_uses_the_charts_redis_and_its_password() -> None:
    docs = chart.render([HUB_VALUES])
    options = _cluster(docs)["gcsFaultToleranceOptions"]
    service = chart.only(docs, "Service")
    assert options["redisAddress"] == f"{service['metadata']['name']}.{chart.NAMESPACE}.svc:6379"
    secret = chart.only(docs, "Secret")
    assert options["redisPassword"] == {
        "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "redis-password"}}
    }
    assert options["externalStorageNamespace"] == "prefixserve-prod"
    # GCS keys carry no TTL: the index's LRU must not evict them.
    args = chart.only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"
    # External Redis: host:port of its URL and its password Secret.
    docs = chart.render([INCREMENTAL_VALUES])
    options = _cluster(docs)["gcsFaultToleranceOptions"]
    assert options == {
        "redisAddress": "redis-master.infra.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}},
    }
    # Off by default, and the index keeps evicting any key.
    docs = chart.render()
    assert "gcsFaultToleranceOptions" not in _cluster(docs)
    args = chart.only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"


def test_incremental_upgrade_strategy_and_http_route() -> None:
    docs = chart.render([INCREMENTAL_VALUES])
    strategy = chart.only(docs, "RayService")["spec"]["upgradeStrategy"]
    assert strategy["type"] == "NewClusterWithIncrementalUpgrade"
    assert strategy["clusterUpgradeOptions"]["gatewayClassName"] == "istio"
    route = chart.only(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "llm-gateway", "namespace": "gateways"}]
    ((backend,),) = [rule["backendRefs"] for rule in route["spec"]["rules"]]
    serve_service = chart.only(docs, "RayService")["spec"]["serveService"]
    assert backend == {
        "name": serve_service["metadata"]["name"],
        "port": serve_service["spec"]["ports"][0]["port"],
    }
    assert not chart.by_kind(docs, "Ingress")


def test_ingress_reaches_the_serve_service() -> None:
    docs = chart.render([HUB_VALUES])
    ingress = chart.only(docs, "Ingress")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    (rule,) = ingress["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    serve_service = chart.only(docs, "RayService")["spec"]["serveService"]
    assert path["backend"]["service"] == {
        "name": serve_service["metadata"]["name"],
        "port": {"name": "http"},
    }
    assert {p["name"] for p in serve_service["spec"]["ports"]} == {"http"}


def test_hub_model_reaches_every_pod() -> None:
    docs = chart.render([HUB_VALUES])
    args = _args(docs)
    assert args["engine"]["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert args["engine"]["revision"] == "main"
    download_dir = args["engine"]["download_dir"]
    assert download_dir.startswith("/models/")
    claim = chart.only(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    for component, template in _pod_specs(docs).items():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        if component == "ray-head":
            # A ReadWriteOnce claim attaches on one node: the workers', never the head's.
            assert "emptyDir" in volumes["model-cache"]
        else:
            assert (
                volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
                == claim["metadata"]["name"]
            )
        (init,) = spec["initContainers"]
        for container in [init, *spec["containers"]]:
            env = _env(container)
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": "hf-token",
                "key": "token",
            }
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts["model-cache"] == "/models"
            assert download_dir.startswith(mounts["model-cache"])
        env = _env(init)
        assert env["PREFIXSERVE_MODEL"]["value"] == args["engine"]["model"]
        assert env["PREFIXSERVE_REVISION"]["value"] == "main"
        assert env["PREFIXSERVE_DOWNLOAD_DIR"]["value"] == download_dir
        # Weights only where engines run; the head (ingress) needs the tokenizer only.
        assert ("weights=True" in init["args"][0]) == (component != "ray-head")
        assert spec["serviceAccountName"] == chart.only(docs, "ServiceAccount")["metadata"]["name"]
        assert spec["securityContext"]["fsGroup"] == 1000


def test_download_script_runs_and_calls_the_engines_downloader() -> None:
    """The initContainer's program, as rendered, run here: it imports the engine's own hub
    downloader, calls it with arguments it takes, and leaves non-hub models alone."""
    from worker import hub

    docs = chart.render(values={"modelDownload": {"enabled": True}})
    (init,) = _pod_specs(docs)["ray-worker-gpu"]["spec"]["initContainers"]
    assert init["command"] == ["python", "-c"]
    script = init["args"][0]
    params = inspect.signature(hub.download_repo).parameters
    for name in re.findall(r"download_repo\(m, (.*)\)", script)[0].split(", "):
        assert name.split("=")[0] in params, f"download_repo takes no {name}"
    env = {**os.environ, **{k: v["value"] for k, v in _env(init).items() if "value" in v}}
    assert env["PREFIXSERVE_MODEL"] == "smollm2"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=chart.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "nothing to download" in proc.stdout


def test_extra_args_reach_the_application_configs() -> None:
    from cluster.config import configs_from_args

    docs = chart.render([HUB_VALUES])
    args = _args(docs)
    engine, cluster, _ = configs_from_args(args)
    assert engine.max_num_seqs == 128  # extraArgs win over engine.maxNumSeqs
    assert engine.host_kv_cache_bytes == 17179869184 and isinstance(engine.host_kv_cache_bytes, int)
    assert engine.gpu_memory_utilization == 0.9
    assert cluster.stream_interval == 4


def test_extra_volumes_and_security_contexts_on_every_ray_container() -> None:
    docs = chart.render([HUB_VALUES])
    for template in _pod_specs(docs).values():
        spec = template["spec"]
        assert {"name": "templates", "configMap": {"name": "chat-templates"}} in spec["volumes"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in [*spec["initContainers"], *spec["containers"]]:
            assert {"name": "templates", "mountPath": "/templates", "readOnly": True} in container[
                "volumeMounts"
            ]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
    redis_spec = chart.only(chart.render(), "StatefulSet")["spec"]["template"]["spec"]
    assert redis_spec["securityContext"]["runAsUser"] == 999


def test_pod_disruption_budget_covers_workers_not_the_head() -> None:
    docs = chart.render([HUB_VALUES])
    budget = chart.only(docs, "PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    pods = _pod_specs(docs)
    assert _selects(budget["selector"], pods["ray-worker-gpu"]["metadata"]["labels"])
    assert not _selects(budget["selector"], pods["ray-head"]["metadata"]["labels"])


def test_cluster_options_of_the_ingress_reach_the_application() -> None:
    from cluster.config import TOOL_CALL_PARSERS, configs_from_args

    docs = chart.render([CI / "tp2-autoscaling-values.yaml"])
    _, cluster, _ = configs_from_args(_args(docs))
    assert (cluster.num_ingress_replicas, cluster.max_ingress_replicas) == (2, 4)
    assert cluster.allowed_origins == ("https://chat.example.com",)
    assert cluster.log_level == "warning"
    assert cluster.tool_call_parser == "hermes" and cluster.enable_auto_tool_choice
    schema = yaml.safe_load((chart.CHART_DIR / "values.schema.json").read_text())
    parsers = schema["properties"]["cluster"]["properties"]["toolCallParser"]["enum"]
    assert set(parsers) - {None} == set(TOOL_CALL_PARSERS)


def test_keda_query_follows_the_metrics_prefix() -> None:
    for prefix, series in (("prefixserve:", "prefixserve:"), ("vllm", "vllm:")):
        docs = chart.render(
            [CI / "keda-values.yaml"], values={"cluster": {"metricsPrefix": prefix}}
        )
        (trigger,) = chart.only(docs, "ScaledObject")["spec"]["triggers"]
        assert trigger["metadata"]["query"].startswith(f"sum({series}num_requests_waiting{{")


def test_init_container_downloads_a_gated_hub_model_the_engine_then_finds_offline(
    tmp_path, monkeypatch
) -> None:
    """The chart's model path end to end, minus Kubernetes: the rendered initContainer program
    runs with the env the pod gets (HF_TOKEN as the Secret would give it) against a loopback
    hub that requires the token; the engine's own resolver then finds the model in the
    rendered download_dir with the hub unreachable (HF_HUB_OFFLINE=1)."""
    from tests.worker.fake_hub import FakeHub, FakeRepo, folder_files
    from worker.loader import resolve_model
    from worker.testing import make_tiny_model

    repo_id, token = "acme/tiny-llama", "hf_secret_for_tests"
    hub = FakeHub(token=token)
    try:
        hub.repos[repo_id] = repo = FakeRepo()
        repo.add_revision(
            "v1", folder_files(make_tiny_model(tmp_path / "tiny", "llama", num_layers=1))
        )
        mount = tmp_path / "models"
        docs = chart.render(
            values={
                "engine": {"model": repo_id, "revision": "v1"},
                "hfToken": {"existingSecret": "hf-token"},
                "modelDownload": {"enabled": True},
                "modelCache": {"mountPath": str(mount)},
            }
        )
        pods = _pod_specs(docs)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        for component in ("ray-head", "ray-worker-gpu"):
            (init,) = pods[component]["spec"]["initContainers"]
            env = {
                **base_env,
                "HF_ENDPOINT": hub.url,
                "HF_TOKEN": token,
            }  # HF_TOKEN: from the Secret
            env.update({k: v["value"] for k, v in _env(init).items() if "value" in v})
            assert _env(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
            proc = subprocess.run(
                [sys.executable, *init["command"][1:], *init["args"]],
                env=env,
                cwd=chart.REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            weights = [p for p in hub.downloaded() if p.endswith(".safetensors")]
            assert bool(weights) == (component != "ray-head"), (component, hub.downloaded())
            hub.requests.clear()
        assert all(auth == f"Bearer {token}" for _, _, auth in hub.requests)
    finally:
        hub.close()
    engine_args = _args(docs)["engine"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: offline for real
    resolved = resolve_model(
        engine_args["model"],
        engine_args["cache_dir"],
        revision=engine_args["revision"],
        download_dir=engine_args["download_dir"],
    )
    assert resolved.path.startswith(str(mount))
    assert any(p.suffix == ".safetensors" for p in Path(resolved.path).iterdir())


def test_resource_names_fit_kuberays_limits() -> None:
    """KubeRay rejects a RayService name over 47 characters (DNS-1035, its RayCluster gets 6
    more)."""
    docs = chart.render(
        values={"fullnameOverride": "a-very-long-release-name-for-a-production-llm-service"}
    )
    name = chart.only(docs, "RayService")["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
