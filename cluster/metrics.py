"""All Prometheus export: vLLM's series names under a prefix (``prefixserve:`` or
``--metrics-prefix``).

Two kinds of process count, and both push plain snapshots to the one ``MetricsHub``
deployment of the application (``push_snapshots_forever``: every ``METRICS_PUSH_PERIOD_S``
while they change, every ``UNCHANGED_PUSH_S`` while they do not):

- Each engine replica (``ReplicaMetrics``): the engine's counters and gauges
  (``AsyncEngine.metrics()``) and the engine-side histograms (inter-token latency, prefill,
  decode and inference time, the engine's own TTFT, queue time and e2e), labelled by
  ``model_name`` and ``replica``. A replica that stops reporting drops out after
  ``STALE_AFTER_S``.
- Each ingress replica (``IngressMetrics``): what a client sees, timed from the moment the
  ingress handler starts (TTFT, end-to-end latency, queue time up to the start of prefill),
  the request-level token histograms, ``request_success_total{finished_reason}``, and its
  process's router counters. These are cumulative, so the hub keeps an ingress's last
  snapshot even after it stops reporting: the sum over ingress replicas never goes down
  while the hub lives (a hub restart is a counter reset, which Prometheus handles).

Any ingress replica answers ``/metrics``: it renders the hub's replica snapshots and the sum of
every ingress's snapshot (its own taken fresh) with ``render_prometheus``, ingress series
labelled by ``model_name`` only. A hub that is down costs metrics and health, never serving;
the ingress then renders its own counts alone. docs/metrics.md maps every series to vLLM's.

This module owns the ``MetricsHub`` deployment (``cluster.metrics.MetricsHub``, bound by
``cluster/app.py``), the push period and staleness, and this process's request-router registry
with the sum of their router metrics (``router_metrics_snapshot``);
the series live in ``cluster/metrics_series.py``, the snapshots in
``cluster/metrics_snapshots.py`` and the rendering in ``cluster/metrics_render.py``: import
them from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from ray import serve

from cluster.priority import lower_own_priority
from router.metrics import merge_snapshots
from worker.cpu_claims import keep_off_claims

log = logging.getLogger("ray.serve")

# The request routers (``cluster.request_router``) alive in this process, for /metrics. Kept
# here because Serve ships the router class to a handle's process pickled by value, with
# copies of its own module's globals: a registry there would stay empty for the ingress.
_REQUEST_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def register_request_router(request_router) -> None:
    _REQUEST_ROUTERS.add(request_router)


def request_routers() -> list:
    """The request routers alive in this process (one per handle's deployment)."""
    return list(_REQUEST_ROUTERS)


def router_metrics_snapshot() -> dict | None:
    """``RouterMetrics.snapshot()`` summed over this process's request routers; None without
    one."""
    total: dict = {}
    for request_router in request_routers():
        total = merge_snapshots(total, request_router.metrics.snapshot())
    return total or None


# Often enough that /health notices a dead engine within seconds, rarely enough to cost nothing.
METRICS_PUSH_PERIOD_S = 1.0
# Three missed pushes: the replica is gone (or hung) and no longer counts as serving.
STALE_AFTER_S = 3 * METRICS_PUSH_PERIOD_S + 2.0
UNCHANGED_PUSH_S = 3 * METRICS_PUSH_PERIOD_S
"""A process whose snapshot has not changed pushes it again only this often (an idle
process's metrics do not move, and each push is a Serve call on both sides); under
``STALE_AFTER_S``, so the hub keeps an engine replica's series, and soon enough that a
restarted hub has every snapshot again within seconds."""


async def push_snapshots_forever(push, snapshot, what: str) -> None:
    """Calls ``await push(snapshot())`` every ``METRICS_PUSH_PERIOD_S`` while the snapshot
    changes, and every ``UNCHANGED_PUSH_S`` while it does not. A failed push (the hub
    restarting) is logged at debug and retried next period: it costs metrics, never serving."""
    last, last_push_s = None, 0.0
    while True:
        current = snapshot()
        now_s = time.monotonic()
        if current != last or now_s - last_push_s >= UNCHANGED_PUSH_S:
            try:
                await push(current)
                last, last_push_s = current, now_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("%s metrics push failed: %s", what, exc)
        await asyncio.sleep(METRICS_PUSH_PERIOD_S)


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},  # one push per replica per second
)
class MetricsHub:
    """Latest snapshot of every replica; replicas push, the ingress reads (and ``prefixserve
    serve``'s drain, for which replicas are live and when they are idle). Its methods are
    coroutines that only touch dicts: Serve would run plain ones on a worker thread, a hop
    there and back for every push of every replica."""

    def __init__(self, support_nice: int = 0) -> None:
        lower_own_priority(support_nice, "metrics hub")
        keep_off_claims("metrics hub")
        self._snapshots: dict[str, tuple[float, dict]] = {}
        self._ingress_snapshots: dict[str, dict] = {}
        """Cumulative counts: kept after an ingress stops, so their sum never goes down."""

    async def report(self, replica_id: str, snapshot: dict) -> None:
        """Stores an engine replica's ``ReplicaMetrics.snapshot()``."""
        self._snapshots[replica_id] = (time.monotonic(), snapshot)

    async def report_ingress(self, ingress_id: str, snapshot: dict) -> None:
        """Stores an ingress replica's ``IngressMetrics.snapshot()``."""
        self._ingress_snapshots[ingress_id] = snapshot

    async def export(self) -> dict:
        """What ``/metrics`` renders: live engine replicas and every ingress snapshot."""
        return {"replicas": self._live(), "ingresses": dict(self._ingress_snapshots)}

    async def snapshots(self) -> dict[str, dict]:
        """The live engine replicas' snapshots."""
        return self._live()

    def _live(self) -> dict[str, dict]:
        now = time.monotonic()
        for replica_id, (seen_at, _) in list(self._snapshots.items()):
            if now - seen_at > STALE_AFTER_S:
                del self._snapshots[replica_id]
        return {replica_id: snap for replica_id, (_, snap) in self._snapshots.items()}


def num_busy_requests(snapshots: dict[str, dict]) -> int:
    """Requests running or waiting over every replica that reported."""
    return sum(
        int(snap.get("engine", {}).get("num_requests_running", 0))
        + int(snap.get("engine", {}).get("num_requests_waiting", 0))
        for snap in snapshots.values()
    )


def any_replica_serving(snapshots: dict[str, dict]) -> bool:
    return any(snap.get("alive", False) for snap in snapshots.values())
