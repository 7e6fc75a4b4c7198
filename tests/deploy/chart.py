"""Renders the Helm chart and validates manifests offline, for the deploy tests.

Owns three things: finding helm (``scripts/get_helm.sh`` installs a pinned copy into the
repo's ``.tools/``; tests skip, naming the reason, only when that fails), running
``helm template``/``helm lint``, and validating rendered objects against the KubeRay v1.7.0
CRD schema vendored in ``deploy/schemas/`` and the core Kubernetes schemas that
``kubernetes-validate`` bundles. CRD schemas are made strict here (unknown fields rejected,
like the API server's strict field validation), so a misspelt field fails a test instead
of being silently pruned on a real cluster.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "prefixserve"
CI_VALUES_FILES = sorted((CHART_DIR / "ci").glob("*.yaml"))
KUBERAY_SCHEMAS_DIR = REPO_ROOT / "deploy" / "schemas" / "kuberay-v1.7.0"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion is >=1.25; 1.30 is the
# oldest release still in common managed offerings, and its schemas carry every field used).
KUBERNETES_VERSION = "1.30"
RELEASE_NAME = "ps"
NAMESPACE = "llm"
# Kinds from operators (and the Gateway API) whose CRDs are not bundled anywhere offline and
# could not be fetched (the test machines reach PyPI, npm and Debian only); they are checked by
# the tests that assert their contents instead.
UNVALIDATED_KINDS = frozenset({"PodMonitor", "ServiceMonitor", "ScaledObject", "HTTPRoute"})
# helm template takes well under a second; a hang means something is badly wrong.
HELM_TIMEOUT_S = 60


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


@functools.lru_cache(maxsize=1)
def install_helm() -> tuple[str | None, str]:
    """(path of a working helm, "") after installing it once, or (None, why not)."""
    script = REPO_ROOT / "scripts" / "get_helm.sh"
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        return None, proc.stderr.strip() or f"get_helm.sh exited {proc.returncode}"
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "helm"), ""


def _run_helm(args: list[str], cwd: Path | None = None) -> str:
    helm, reason = install_helm()
    if helm is None:
        raise HelmError(f"helm is not installed: {reason}")
    proc = subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_S, check=False, cwd=cwd
    )
    if proc.returncode != 0:
        raise HelmError(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


def _values_args(values_files: list[Path], values: dict[str, Any] | None, tmp: str) -> list[str]:
    args: list[str] = []
    for path in values_files:
        args += ["-f", str(path)]
    if values is not None:
        override = Path(tmp) / "override-values.yaml"
        override.write_text(yaml.safe_dump(values))
        args += ["-f", str(override)]
    return args


def render(
    values_files: list[Path] | None = None, values: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``helm template`` the chart; returns the non-empty documents."""
    with tempfile.TemporaryDirectory() as tmp:
        out = _run_helm(
            ["template", RELEASE_NAME, str(CHART_DIR), "--namespace", NAMESPACE]
            + _values_args(values_files or [], values, tmp)
        )
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_args(args: list[str]) -> list[dict[str, Any]]:
    """``helm template`` with the value flags (``-f``, ``--set``, ...) of a documented
    ``helm install`` command, run from the repo root as the docs say."""
    out = _run_helm(
        ["template", RELEASE_NAME, str(CHART_DIR), "--namespace", NAMESPACE, *args],
        cwd=REPO_ROOT,
    )
    return [doc for doc in yaml.safe_load_all(out) if doc]


def lint(values_files: list[Path] | None = None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return _run_helm(
            ["lint", "--strict", str(CHART_DIR)] + _values_args(values_files or [], None, tmp)
        )


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}, rendered {len(found)}")
    return found[0]


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The RayService's serveConfigV2, parsed."""
    return yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"])


def _strict(schema: Any) -> Any:
    """Rejects unknown fields wherever the CRD lists the known ones."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def kuberay_validator(kind: str) -> jsonschema.Draft7Validator:
    """Validator of a KubeRay kind (RayService, RayCluster, RayJob) at ray.io/v1."""
    path = KUBERAY_SCHEMAS_DIR / f"ray.io_{kind.lower()}s.yaml"
    if not path.exists():
        raise FileNotFoundError(
            f"KubeRay CRD schema {path} is missing: "
            "deploy/schemas/README.md says where it comes from"
        )
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def validate_manifest(doc: dict[str, Any]) -> None:
    """Raises on a manifest that the KubeRay CRDs or core Kubernetes schemas reject."""
    import kubernetes_validate

    kind = doc["kind"]
    if doc["apiVersion"] == "ray.io/v1":
        errors = sorted(kuberay_validator(kind).iter_errors(doc), key=lambda e: list(e.path))
        if errors:
            raise ValueError(
                f"{kind} {doc['metadata']['name']}: "
                + "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5])
            )
        # The pod templates inside are core objects too: validate them strictly as such.
        cluster = doc["spec"].get("rayClusterConfig", doc["spec"])
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for group in groups:
            pod_template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": doc["metadata"]["name"]},
                "template": group["template"],
            }
            kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
    elif kind not in UNVALIDATED_KINDS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
