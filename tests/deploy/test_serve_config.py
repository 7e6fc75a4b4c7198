"""deploy/serve_config.yaml is a valid Serve config whose args build every layer's config
and list every option, so users can discover and tune all of them in one file."""

from __future__ import annotations

import dataclasses

import yaml

from tests.deploy import chart

SERVE_CONFIG_PATH = chart.REPO_ROOT / "deploy" / "serve_config.yaml"
# Fields deliberately left out: the file is deployed onto a cluster that already exists (no
# Ray address to join), and a secret never belongs in a config file (the API key comes from
# the env variable PREFIXSERVE_API_KEY).
# The application sets claim_cpus from cluster.engine_cpu_affinity and num_cpus_per_replica.
NOT_IN_SERVE_CONFIG = {"cluster": {"ray_address", "api_key"}, "engine": {"claim_cpus"}}


def _load() -> dict:
    return yaml.safe_load(SERVE_CONFIG_PATH.read_text())


def test_serve_config_validates_and_builds_every_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ClusterConfig
    from router.config import RouterConfig
    from worker.config import EngineConfig

    config = _load()
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    args = app["args"]
    engine = EngineConfig(**args["engine"])
    router = RouterConfig(**args["router"])
    cluster = ClusterConfig(**args["cluster"])
    assert router.block_size == engine.block_size
    assert cluster.app_name == app["name"]
    assert cluster.port == config["http_options"]["port"]
    assert cluster.max_ongoing_requests >= engine.max_num_seqs


def test_serve_config_lists_every_option() -> None:
    from cluster.config import ClusterConfig
    from router.config import RouterConfig
    from worker.config import EngineConfig

    args = _load()["applications"][0]["args"]
    for section, cls in (
        ("engine", EngineConfig),
        ("router", RouterConfig),
        ("cluster", ClusterConfig),
    ):
        fields = {f.name for f in dataclasses.fields(cls)} - NOT_IN_SERVE_CONFIG.get(section, set())
        missing = fields - set(args[section])
        assert not missing, f"deploy/serve_config.yaml args.{section} lacks {sorted(missing)}"
