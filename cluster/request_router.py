"""Ray Serve's ``RequestRouter`` for the engine replicas: ``router.routing.Router`` in Serve.

Owns the per-request decision of every ``DeploymentHandle`` to ``EngineReplica`` (the
ingress's). For a ``generate`` call it reads the request's ``block_hashes`` (hashed once at
the ingress) and prompt length from the call's arguments, builds one
``router.policy.ReplicaView`` per candidate from the replica's Serve routing stats
(``EngineReplica.record_routing_stats``) plus the requests sent it that have not finished,
counted from the decision on, with the prompt tokens each will prefill there: this router's
own (``cluster.inflight``) and the other ingress replicas' routers' (``cluster.inflight_board``,
read beside the index lookup), and lets ``Router.route`` decide: one
index lookup, the configured policy (``prefix`` by default, or
``round_robin``/``least_loaded``/``pow2``), a speculative entry for the chosen replica. Other
calls (``describe``) carry no blocks and go by load.

The chosen replica is returned as the first rank and every other candidate as the second,
so Serve falls through to the least loaded of the others when the chosen one is full.

With ``kv_pull_tokens_per_s`` set, a choice priced with a pull from a peer (``Decision``'s
``pull_from``/``pull_blocks``) is written into the call's ``kv_pull`` keyword
(``kv_pull_order``) before Serve sends it, so the chosen replica pulls what it was priced
with (``EngineReplica.generate``); each routing attempt rewrites or removes it.

How it fails: the lookup is awaited on Serve's event loop (a worker thread for a Redis
index) with a short timeout (see ``cluster.index_actor``); an unreachable index makes the
decision by load alone, logged once and counted (reason ``fallback``) until the index
answers again. With the Redis backend the Redis keys are namespaced by model, which this
router learns from the replicas' routing stats; until a replica has reported, the policy
decides without matches (by load; the ``prefix`` policy then settles ties by rendezvous on
the first block). An unreachable in-flight board leaves each router counting only its own
in-flight requests (logged once).
``router_metrics_snapshot`` returns this process's router metrics for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.index_actor import (
    MIN_ACTOR_LOOKUP_TIMEOUT_S,
    get_or_create_index_actor,
    make_cluster_index,
)
from cluster.inflight import InflightLedger
from cluster.inflight_board import ActorBoardClient, merge_inflight
from cluster.metrics import register_request_router, request_routers
from cluster.serve_compat import (
    ask_to_back_off,
    check_serve_internals,
    request_key,
    set_request_kwarg,
)
from router.config import RouterConfig
from router.metrics import RouterMetrics, merge_snapshots
from router.policies import make_policy
from router.policy import Decision, ReplicaView, RoutingReason
from router.protocol import ReplicaStats
from router.routing import Lookup, Router

log = logging.getLogger("ray.serve")
check_serve_internals()  # a Ray without what serve_compat needs fails here, saying which

ROUTER_CLASS_PATH = "cluster.request_router:PrefixAwareRequestRouter"
# A one-line summary of the router metrics in the replica log this often, for clusters that
# scrape no /metrics; rare enough to be noise-free.
METRICS_LOG_PERIOD_S = 60.0
# A decision never confirmed by Serve (the caller gave up before it was sent) stops counting
# as in flight on its replica after this long (``cluster.inflight``).
UNCONFIRMED_DECISION_TTL_S = 5.0
KV_PULL_KWARG = "kv_pull"
"""The ``generate`` keyword that carries a pull order to the replica (``kv_pull_order``)."""


def request_blocks(pending_request: PendingRequest | None) -> tuple[list[bytes], int]:
    """(block hashes, prompt tokens) of a ``generate`` call; ``([], 0)`` for other calls."""
    if pending_request is None:
        return [], 0
    kwargs = pending_request.kwargs or {}
    hashes = kwargs.get("block_hashes")
    if not isinstance(hashes, list):
        return [], 0
    prompt = kwargs.get("prompt_token_ids")
    if prompt is None and len(pending_request.args) > 1:
        prompt = pending_request.args[1]
    num_prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
    return hashes, num_prompt_tokens


def kv_pull_order(decision: Decision) -> dict | None:
    """What the chosen replica is told to pull before admitting the request:
    ``{"replica_id", "peer_id", "num_blocks"}``, or None when the choice was not priced with a
    pull. ``replica_id`` names the replica the order is for: Serve may send the call to
    another one (the chosen one was full), which then ignores it and prefills."""
    if decision.pull_from is None or decision.pull_blocks <= 0:
        return None
    return {
        "replica_id": decision.replica_id,
        "peer_id": decision.pull_from,
        "num_blocks": decision.pull_blocks,
    }


def live_replicas(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The candidates whose last routing stats say their engine is alive
    (``ReplicaStats.engine_alive``; no stats yet counts as alive); all of them when none
    is, so Serve still has somewhere to send until its health check replaces the dead."""
    live = [r for r in replicas if (r.routing_stats or {}).get("engine_alive", True)]
    return live or replicas


def pooled_prefill_rate(all_stats: list[ReplicaStats]) -> list[ReplicaStats]:
    """The replicas' stats with one prefill rate for those that measured one: the median.

    One deployment's replicas run one engine configuration on one kind of hardware; what
    their measured prefill rates differ by is the load and contention while they measured
    (on a shared CPU a busy replica measured 190 tokens/s, an idle one 80). Priced per
    replica, a replica that measured slow looked dear for every cold prompt, got none and
    never measured again (a 3-replica run sent 40, 20 and 4 of 64 requests). A replica that
    has measured nothing keeps 0, the model's configured default: it is idle, so it gets
    requests and measures."""
    rates = [s.prefill_tokens_per_s for s in all_stats if s.prefill_tokens_per_s > 0]
    if not rates:
        return all_stats
    rate = statistics.median(rates)
    return [
        dataclasses.replace(s, prefill_tokens_per_s=rate) if s.prefill_tokens_per_s > 0 else s
        for s in all_stats
    ]


class PrefixAwareRequestRouter(RequestRouter):
    """Routes each request where the configured policy says (predicted TTFT by default)."""

    def initialize_state(self, router_config: dict | None = None) -> None:
        self.config = RouterConfig(**(router_config or {}))
        self.metrics = RouterMetrics()
        self._router: Router | None = None
        self._load_policy = make_policy(self.config)
        """Decides, with no index, until the Redis namespace (the model) is known."""
        self._router_lock = threading.Lock()
        self._inflight = InflightLedger(UNCONFIRMED_DECISION_TTL_S, self._ledger_changed)
        self._board = None
        """Shares ``_inflight`` with the other ingress replicas' routers (``_get_board``)."""
        self._board_lock = threading.Lock()
        self._next_metrics_log_s = time.monotonic() + METRICS_LOG_PERIOD_S
        self._removals = ThreadPoolExecutor(1, thread_name_prefix="prefixserve-index-removal")
        """Tells the index about replicas that left, off Serve's event loop (a round trip)."""
        register_request_router(self)  # for router_metrics_snapshot

    # ---------------------------------------------------------------------- the decision
    def _get_router(self, replicas: list[RunningReplica]) -> Router | None:
        if self._router is not None:
            return self._router
        model_id = ""
        if self.config.index_backend == "redis":
            model_id = next(
                (r.routing_stats.get("model_id") for r in replicas if r.routing_stats), None
            )
            if not model_id:
                return None
        with self._router_lock:
            if self._router is None:
                index = make_cluster_index(self.app_name, self.config, model_id)
                self._router = Router(self.config, model_id, index=index, metrics=self.metrics)
        return self._router

    def _get_board(self):
        """This router's client of the application's in-flight board, created on first use;
        None for a router outside a Serve deployment (nobody to share with). Tests set
        ``_board`` themselves (``cluster.inflight_board.LocalBoardClient``)."""
        if self._board is not None or not ray.is_initialized():
            return self._board
        try:
            app_name = self.app_name
        except AttributeError:  # built without Serve's __init__ (a test): no application
            return None
        with self._board_lock:
            if self._board is None:
                self._board = ActorBoardClient(
                    lambda: get_or_create_index_actor(app_name, self.config),
                    self._inflight.timed_snapshot,
                    max(self.config.redis_socket_timeout_s, MIN_ACTOR_LOOKUP_TIMEOUT_S),
                )
        return self._board

    def _ledger_changed(self) -> None:
        if self._board is not None:
            self._board.changed()

    async def _peer_inflight(self) -> dict | None:
        """The other routers' in-flight requests; ``{}`` for a router outside a Serve
        deployment (it has no peers), None when the board does not answer."""
        board = self._get_board()
        return {} if board is None else await board.peers_async()

    def _views(
        self, replicas: list[RunningReplica], peers: dict | None = None
    ) -> list[ReplicaView]:
        inflight = merge_inflight(self._inflight.timed_snapshot(), peers or {})
        complete = peers is not None  # every router's requests: the load now (ReplicaView)
        all_stats = pooled_prefill_rate(
            [ReplicaStats.from_dict(r.routing_stats or {}) for r in replicas]
        )
        # The requests awaiting their first output are the prefill queue now, once this
        # router's callers are seen reporting first outputs (``cluster.inflight``).
        pending_known = complete and self._inflight.marks_first_outputs
        views = []
        for r, stats in zip(replicas, all_stats, strict=True):
            entries = inflight.get(r.replica_id.unique_id, ())
            num_unreported = None  # stats without a time: the policy estimates
            if stats.as_of_s > 0:
                num_unreported = sum(1 for at_s, _, _ in entries if at_s > stats.as_of_s)
            prefill_tokens = tuple(tokens for _, tokens, _ in entries)
            pending = None
            if pending_known:
                pending = tuple(tokens for _, tokens, awaiting in entries if awaiting)
            views.append(
                ReplicaView(
                    r.replica_id.unique_id,
                    stats,
                    len(entries),
                    prefill_tokens,
                    num_unreported,
                    inflight_complete=complete,
                    pending_prefill_tokens=pending,
                )
            )
        return views

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            ask_to_back_off(pending_request)  # else Serve retries a full set in a tight loop
        if not candidate_replicas:
            return []
        candidate_replicas = live_replicas(candidate_replicas)
        hashes, num_prompt_tokens = request_blocks(pending_request)
        router = self._get_router(candidate_replicas)
        lookup = Lookup({})
        if router is not None and hashes:  # index and board round trips, together
            lookup, peers = await asyncio.gather(router.lookup_async(hashes), self._peer_inflight())
        else:
            peers = await self._peer_inflight()
        # From here to the ledger entry nothing awaits: concurrent decisions (a burst) each
        # see the ones before them, in the views and in the router's recent decisions.
        views = self._views(candidate_replicas, peers)
        if router is None:
            decision = self._load_policy.choose(hashes, num_prompt_tokens, views, {})
            self.metrics.record_decision(self.config.policy, RoutingReason.FALLBACK, len(hashes), 0)
        else:
            decision = router.decide(hashes, num_prompt_tokens, views, lookup)
        if pending_request is not None and hashes:  # a generate call: the order travels in it
            set_request_kwarg(pending_request, KV_PULL_KWARG, kv_pull_order(decision))
        if pending_request is not None:
            matched_tokens = decision.matched_blocks * self.config.block_size
            prefill_tokens = max(0, num_prompt_tokens - matched_tokens)
            self._inflight.decided(
                request_key(pending_request), decision.replica_id, prefill_tokens
            )
            self._ledger_changed()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "routed %d blocks to %s (%s, matched %d, predicted TTFT %.3f s); saw %s",
                len(hashes),
                decision.replica_id,
                decision.reason,
                decision.matched_blocks,
                decision.predicted_ttft_s,
                _describe(views, lookup.matches or {}),
            )
        self._maybe_log_metrics()
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == decision.replica_id]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != decision.replica_id]
        return [chosen, others] if others else [chosen]

    def _maybe_log_metrics(self) -> None:
        now_s = time.monotonic()
        if now_s < self._next_metrics_log_s:
            return
        self._next_metrics_log_s = now_s + METRICS_LOG_PERIOD_S
        snap = self.metrics.snapshot()
        log.info(
            "router %s: decisions %s, matched-block ratio %s, fallbacks %d, index errors %d",
            self.config.policy,
            {f"{row['policy']}/{row['reason']}": row["count"] for row in snap["decisions"]},
            snap["matched_block_ratio"],
            snap["num_fallback_decisions"],
            snap["num_index_errors"],
        )

    # ------------------------------------------------------------ in-flight bookkeeping
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        self._inflight.routed(request_key(pending_request), replica_id.unique_id)
        self._ledger_changed()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.completed(internal_request_id, replica_id.unique_id)
        self._ledger_changed()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        gone = before - {rid.unique_id for rid in self.curr_replicas}
        router = self._router
        if gone and router is not None:  # their entries stop counting now, not at timeout
            for unique_id in gone:
                self._removals.submit(router.index.remove_replica, unique_id)

    def close(self) -> None:
        self._removals.shutdown(wait=False)
        if self._board is not None:
            self._board.close()
        if self._router is not None:
            self._router.close()


def _describe(views: list[ReplicaView], matches: dict) -> str:
    """What a decision saw, per replica (the debug log): waiting + running requests, the
    router's in-flight count, queued prefill tokens, the index's device + host blocks."""
    parts = []
    for view in views:
        stats, match = view.stats, matches.get(view.replica_id)
        held = "-" if match is None else f"{match.device_blocks}+{match.host_blocks}"
        parts.append(
            f"{view.replica_id}: {stats.num_waiting}w+{stats.num_running}r inflight "
            f"{view.num_inflight} queued {stats.num_queued_prefill_tokens} held {held}"
        )
    return "; ".join(parts)


def router_metrics_snapshot() -> dict | None:
    """``RouterMetrics.snapshot()`` summed over this process's routers; None without one."""
    total: dict = {}
    for request_router in request_routers():
        total = merge_snapshots(total, request_router.metrics.snapshot())
    return total or None


def request_router_config(config: RouterConfig, stats_period_s: float) -> dict:
    """``request_router_config`` deployment option that installs this router."""
    return {
        "request_router_class": ROUTER_CLASS_PATH,
        "request_router_kwargs": {"router_config": dataclasses.asdict(config)},
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(stats_period_s, 1.0) * 5,
    }
