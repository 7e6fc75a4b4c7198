"""The Serve application builder: ``import_path: cluster.app:build_app`` in a Serve config.

``build_app({"engine": {...}, "cluster": {...}, "router": {...}})`` validates the three config
dataclasses (each section may be omitted; unknown keys are a ``ValueError`` naming them) and
binds three deployments: ``EngineReplica`` x ``num_replicas`` (one engine each),
``MetricsHub`` (one, no CPU) and ``Ingress`` (FastAPI, no CPU). The router's block size
follows the engine's; a conflicting explicit value is an error, because the router's hashes
would never match the engines' blocks.

Placement (``replica_resource_options``, a pure function of the configs and the cluster's GPU
count): a replica reserves ``num_cpus_per_replica`` CPUs and one GPU on CUDA, so Ray gives
each replica its own device (``CUDA_VISIBLE_DEVICES``). ``device: auto`` reserves GPUs when the
Ray cluster has any (``ray.cluster_resources()``, asked once when the app is built, logged).
With ``engine.tensor_parallel_size`` N > 1 each replica asks Serve for a ``STRICT_PACK``
placement group of N bundles (one per rank, each with the same CPUs and GPU); the replica
runs in bundle 0 and starts ranks 1..N-1 in the others.

The ingress runs ``ClusterConfig.ingress_replicas`` replicas (2 by default when more than one
engine replica runs), autoscaled up to ``max_ingress_replicas`` when that is larger; every
ingress routes through the same prefix index (one ``IndexActor`` per app, or Redis).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from ray import serve

from cluster.config import ClusterConfig, configs_from_args
from cluster.ingress import Ingress
from cluster.metrics import MetricsHub
from cluster.replica import EngineReplica
from cluster.request_router import request_router_config
from router.config import RouterConfig
from worker.config import EngineConfig

log = logging.getLogger("ray.serve")

# The ingress only parses and relays, so it can hold far more requests than the replicas;
# its limit must not be what bounds concurrency (Serve's default of 5 would).
INGRESS_MAX_ONGOING_REQUESTS = 4096
# Health probes every few seconds notice a dead engine loop quickly; the timeout covers a
# replica busy with a long CPU prefill that delays the probe.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# Read by the engine processes (worker/engine_process.py) and TP workers for their own logging.
LOG_LEVEL_ENV = "PREFIXSERVE_LOG_LEVEL"
# Shutdown: Serve waits this long for in-flight requests before calling EngineReplica.__del__
# (which aborts what is left) and then killing the actor.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 15.0
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5
# Ray Serve settings for every process of the application: each deployment's through its
# runtime_env, a local cluster's controller and proxy through the environment `prefixserve
# serve` starts Ray in. What the user's environment sets wins (``serve_env``).
SERVE_ENV = {
    # Serve's own "throughput optimized" event loops (part of RAY_SERVE_THROUGHPUT_OPTIMIZED):
    # a replica's code runs on the loop that receives its calls, and a handle's router on the
    # loop that calls it, instead of each on a thread of its own with a hop between them per
    # message, which costs CPU and latency per message (docs/design.md, Decisions).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # How often each replica and handle hands the request counts and latencies it cached to
    # Ray's metrics (Serve's own `serve_deployment_*` series): once a second, not Serve's ten
    # times, which wake every idle replica's event loop for nothing a scrape every 10-15 s
    # would see.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # How often Serve's controller reconciles: every 0.5 s, not Serve's 0.1 s. Each pass asks
    # the GCS for the nodes and deep-copies every application's target state, so at 0.1 s the
    # controller and the GCS spend about twice the CPU they do at 0.5 s, idle or loaded
    # (bench/README.md, Scale). What the loop reacts to is slower than 0.5 s anyway: health
    # checks every HEALTH_CHECK_PERIOD_S, autoscaling over seconds; routers drop a dead
    # replica on their own first failed call.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
# How often Serve collects each replica's routing stats (queue, prefill rate) for the
# router: often enough to see a burst build up, rarely enough to cost the controller little.
ROUTING_STATS_PERIOD_S = 1.0


def request_router_options(router: RouterConfig) -> dict:
    """Serve deployment options that install ``cluster.request_router`` for ``router``."""
    return {"request_router_config": request_router_config(router, ROUTING_STATS_PERIOD_S)}


def gpus_per_replica(device: str, cluster: ClusterConfig, cluster_gpus: float) -> float:
    """GPUs one engine replica (and under tensor parallelism each rank's bundle) reserves:
    the explicit ``num_gpus_per_replica``, else 1 on CUDA, and on ``auto`` 1 when the Ray
    cluster has GPUs (``cluster_gpus``), else 0."""
    if cluster.num_gpus_per_replica is not None:
        return float(cluster.num_gpus_per_replica)
    if device.startswith("cuda") or (device == "auto" and cluster_gpus > 0):
        return 1.0
    return 0.0


def replica_resource_options(
    engine: EngineConfig, cluster: ClusterConfig, cluster_gpus: float = 0.0
) -> dict:
    """Deployment options reserving each engine replica's CPUs and GPUs: its actor's, and under
    tensor parallelism one ``STRICT_PACK`` placement-group bundle per rank."""
    gpus = gpus_per_replica(engine.device, cluster, cluster_gpus)
    actor = {"num_cpus": cluster.num_cpus_per_replica, "num_gpus": gpus}
    tp = engine.tensor_parallel_size
    if tp == 1:
        return {"ray_actor_options": actor}
    bundle = {"CPU": cluster.num_cpus_per_replica}
    if gpus:
        bundle["GPU"] = gpus
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(tp)],
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": actor,
    }


def ray_cluster_gpus(engine: EngineConfig, cluster: ClusterConfig) -> float:
    """The Ray cluster's GPUs when placement depends on them (``device: auto`` and no explicit
    ``num_gpus_per_replica``), else 0; asked once, when the app is built, and logged."""
    if engine.device != "auto" or cluster.num_gpus_per_replica is not None:
        return 0.0
    import ray

    gpus = float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0
    log.info(
        "device auto: the Ray cluster has %g GPU(s); each engine replica reserves %s",
        gpus,
        f"{engine.tensor_parallel_size} GPU(s)" if gpus > 0 else "none (CPU)",
    )
    return gpus


def logging_options(cluster: ClusterConfig) -> dict:
    """Serve's per-deployment logging: the level, and the access log (a line per request) only
    on request."""
    return {
        "logging_config": {
            "enable_access_log": cluster.enable_log_requests,
            "log_level": cluster.log_level.upper(),
        }
    }


def serve_env() -> dict[str, str]:
    """``SERVE_ENV``, each variable as this process's environment sets it if it does."""
    return {name: os.environ.get(name, value) for name, value in SERVE_ENV.items()}


PROXY_GRPC_ENV = "RAY_SERVE_PROXY_USE_GRPC"
"""Ray Serve's switch for its proxy's calls to the ingress over gRPC: read by the proxy when it
starts, so only a local cluster's follows ``ClusterConfig.handle_transport``."""
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
"""Ray Serve's switch for direct ingress (``ClusterConfig.direct_ingress``): read by the
controller and by each replica's process when Serve is imported there."""


def runtime_env(cluster: ClusterConfig) -> dict:
    """Env variables of every deployment's processes (and their children: engine processes):
    the log level, Serve's event loops and metrics export (``SERVE_ENV``) and, with
    ``direct_ingress``, Serve's direct-ingress switch."""
    env = {LOG_LEVEL_ENV: cluster.log_level.upper(), **serve_env()}
    if cluster.direct_ingress:
        env[DIRECT_INGRESS_ENV] = "1"
    return {"env_vars": env}


def ingress_options(cluster: ClusterConfig) -> dict:
    """The ingress's replicas (fixed, or Serve autoscaling between the two bounds), no CPU."""
    options = {
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
        "ray_actor_options": {"num_cpus": 0, "runtime_env": runtime_env(cluster)},
        **logging_options(cluster),
    }
    low, high = cluster.ingress_replicas, cluster.max_ingress_replicas
    if high is not None and high > low:
        options["autoscaling_config"] = {
            "min_replicas": low,
            "initial_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": cluster.ingress_target_ongoing_requests,
        }
    else:
        options["num_replicas"] = low
    return options


def engine_replica_options(
    engine: EngineConfig, cluster: ClusterConfig, router: RouterConfig, cluster_gpus: float = 0.0
) -> dict:
    """Every deployment option of the engine replicas (a pure function: no Ray needed)."""
    options = {
        "num_replicas": cluster.num_replicas,
        "max_ongoing_requests": cluster.max_ongoing_requests,
        "max_queued_requests": cluster.max_queued_requests if cluster.max_queued_requests else -1,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        **request_router_options(router),
        **logging_options(cluster),
        **replica_resource_options(engine, cluster, cluster_gpus),
    }
    options["ray_actor_options"]["runtime_env"] = runtime_env(cluster)
    return options


def build_app_from_configs(
    engine: EngineConfig, cluster: ClusterConfig, router: RouterConfig
) -> serve.Application:
    hub = MetricsHub.options(**logging_options(cluster)).bind(cluster.support_nice)
    replica_options = engine_replica_options(
        engine, cluster, router, ray_cluster_gpus(engine, cluster)
    )
    engine_dict = dataclasses.asdict(
        dataclasses.replace(engine, claim_cpus=cluster.engine_cpus_to_claim)
    )
    replicas = EngineReplica.options(**replica_options).bind(
        engine_dict,
        hub,
        cluster.served_model_name or "",
        dataclasses.asdict(router),
        cluster.stream_interval,
    )
    return Ingress.options(**ingress_options(cluster)).bind(
        replicas, hub, engine_dict, dataclasses.asdict(cluster), dataclasses.asdict(router)
    )


def build_app(args: dict) -> serve.Application:
    """Serve's application builder (``import_path: cluster.app:build_app``)."""
    return build_app_from_configs(*configs_from_args(args))
