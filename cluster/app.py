"""The Serve application builder: ``import_path: cluster.app:build_app`` in a Serve config.

``build_app({"engine": {...}, "cluster": {...}, "router": {...}})`` validates the three config
dataclasses (each section may be omitted; unknown keys are a ``ValueError`` naming them) and
binds three deployments: ``EngineReplica`` x ``num_replicas`` (one engine each),
``MetricsHub`` (one, no CPU) and ``Ingress`` (FastAPI, no CPU). The router's block size
follows the engine's; a conflicting explicit value is an error, because the router's hashes
would never match the engines' blocks.

With ``engine.tensor_parallel_size`` N > 1 each replica asks Serve for a ``STRICT_PACK``
placement group of N bundles (one per rank: the replica's own CPUs, and one GPU per rank on
CUDA); the replica runs in bundle 0 and starts ranks 1..N-1 in the others.
"""

from __future__ import annotations

import dataclasses

from ray import serve

from cluster.config import ClusterConfig, configs_from_args
from cluster.ingress import Ingress
from cluster.metrics import MetricsHub
from cluster.replica import EngineReplica
from cluster.request_router import request_router_config
from router.config import RouterConfig
from worker.config import EngineConfig

# The ingress only parses and relays, so it can hold far more requests than the replicas;
# its limit must not be what bounds concurrency (Serve's default of 5 would).
INGRESS_MAX_ONGOING_REQUESTS = 4096
# Health probes every few seconds notice a dead engine loop quickly; the timeout covers a
# replica busy with a long CPU prefill that delays the probe.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# Shutdown: Serve waits this long for in-flight requests before calling EngineReplica.__del__
# (which aborts what is left) and then killing the actor.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 15.0
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5
# How often Serve collects each replica's routing stats (queue, prefill rate) for the
# router: often enough to see a burst build up, rarely enough to cost the controller little.
ROUTING_STATS_PERIOD_S = 1.0


def request_router_options(router: RouterConfig) -> dict:
    """Serve deployment options that install ``cluster.request_router`` for ``router``."""
    return {"request_router_config": request_router_config(router, ROUTING_STATS_PERIOD_S)}


def tensor_parallel_options(engine: EngineConfig, cluster: ClusterConfig) -> dict:
    """Deployment options that reserve one placement-group bundle per tensor-parallel rank."""
    tp = engine.tensor_parallel_size
    if tp == 1:
        return {}
    gpus_per_rank = 1.0 if engine.device.startswith("cuda") else cluster.num_gpus_per_replica
    bundle = {"CPU": cluster.num_cpus_per_replica}
    if gpus_per_rank:
        bundle["GPU"] = gpus_per_rank
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(tp)],
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": cluster.num_cpus_per_replica, "num_gpus": gpus_per_rank},
    }


def logging_options(cluster: ClusterConfig) -> dict:
    """Serve's per-deployment logging: the access log (a line per request) only on request."""
    return {"logging_config": {"enable_access_log": cluster.enable_log_requests}}


def build_app_from_configs(
    engine: EngineConfig, cluster: ClusterConfig, router: RouterConfig
) -> serve.Application:
    hub = MetricsHub.options(**logging_options(cluster)).bind()
    replica_options = {
        "num_replicas": cluster.num_replicas,
        "max_ongoing_requests": cluster.max_ongoing_requests,
        "max_queued_requests": cluster.max_queued_requests if cluster.max_queued_requests else -1,
        "ray_actor_options": {
            "num_cpus": cluster.num_cpus_per_replica,
            "num_gpus": cluster.num_gpus_per_replica,
        },
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        **request_router_options(router),
        **logging_options(cluster),
    }
    replica_options.update(tensor_parallel_options(engine, cluster))
    engine_dict = dataclasses.asdict(engine)
    replicas = EngineReplica.options(**replica_options).bind(
        engine_dict,
        hub,
        cluster.served_model_name or "",
        dataclasses.asdict(router),
        cluster.stream_interval,
    )
    return Ingress.options(
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
        **logging_options(cluster),
    ).bind(replicas, hub, engine_dict, dataclasses.asdict(cluster))


def build_app(args: dict) -> serve.Application:
    """Serve's application builder (``import_path: cluster.app:build_app``)."""
    return build_app_from_configs(*configs_from_args(args))
