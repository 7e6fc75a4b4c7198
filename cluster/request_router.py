"""Ray Serve's ``RequestRouter`` for the engine replicas: ``router.routing.Router`` in Serve.

Owns the per-request decision of every ``DeploymentHandle`` to ``EngineReplica`` (the
ingress's). For a ``generate`` call it reads the request's ``block_hashes`` (hashed once at
the ingress, in its adapter's namespace), its LoRA adapter (``lora_name``, absent or None for
the base model; ``request_adapter``) and prompt length from the call's arguments, builds one
``router.policy.ReplicaView`` per candidate (its Serve routing stats,
``EngineReplica.record_routing_stats``, and its load from ``router.load``: the process's
``LoadTracker``, shared with the ingress's client through ``cluster.router_context``, merged
with what the other ingress replicas' routers track, read from this router's copy of the
index actor, ``cluster.index_mirror``) and lets ``Router`` decide: one index lookup (in that
copy, with the embedded index: no round trip), the configured policy
(``prefix`` by default, which also prices loading the adapter on a replica whose stats'
``lora_adapters`` lack it, or ``round_robin``/``least_loaded``/``pow2``), a speculative entry
for the chosen replica. Then it tells the tracker (``decided``, and Serve's ``routed`` and
``completed`` callbacks). Other calls (``describe``) carry no blocks and go by load.

The chosen replica is returned as the first rank and every other candidate as the second,
so Serve falls through to the least loaded of the others when the chosen one is full.

With ``kv_pull_tokens_per_s`` set, a choice priced with a pull from a peer (``Decision``'s
``pull_from``/``pull_blocks``) is written into the call's ``kv_pull`` keyword
(``kv_pull_order``) before Serve sends it, so the chosen replica pulls what it was priced
with (``EngineReplica.generate``); each routing attempt rewrites or removes it.

How it fails: a Redis lookup is awaited on Serve's event loop (in a worker thread) with a
short timeout; an unreachable index, or a copy of the embedded one that stopped syncing
(``cluster.index_mirror.STALE_AFTER_S``), makes the decision by load alone, logged once and
counted (reason ``fallback``) until the index answers again. With the Redis backend the
Redis keys are namespaced by model, which the ingress of this process puts in its
``RouterContext`` once a replica has described itself;
until then (and in a process with no ingress) the policy decides without matches (by load;
the ``prefix`` policy then settles ties by rendezvous on the first block). An index actor
that stops answering leaves the other routers' requests to the replicas' stats (logged
once).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.index_actor import ActorIndexClient, get_or_create_index_actor, make_cluster_index
from cluster.index_mirror import ActorMirror, MirroredIndex
from cluster.inflight_board import ActorBoardClient, LocalBoardClient
from cluster.metrics import register_request_router
from cluster.router_context import RouterContext, router_context
from cluster.serve_compat import (
    ask_to_back_off,
    check_serve_internals,
    request_key,
    set_request_kwarg,
)
from router.config import RouterConfig
from router.load import LoadSnapshot, LoadTracker
from router.metrics import RouterMetrics
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
KV_PULL_KWARG = "kv_pull"
"""The ``generate`` keyword that carries a pull order to the replica (``kv_pull_order``)."""
LORA_KWARG = "lora_name"
"""The ``generate`` keyword naming the request's LoRA adapter (absent or None: the base model)."""


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


def request_adapter(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter a call runs on (its ``lora_name`` keyword); None for the base model,
    for a call without one and for anything but a non-empty name."""
    if pending_request is None:
        return None
    lora_name = (pending_request.kwargs or {}).get(LORA_KWARG)
    return lora_name if isinstance(lora_name, str) and lora_name else None


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


class PrefixAwareRequestRouter(RequestRouter):
    """Routes each request where the configured policy says (predicted TTFT by default)."""

    def initialize_state(
        self,
        router_config: dict | None = None,
        *,
        context: RouterContext | None = None,
        router: Router | None = None,
        board: LocalBoardClient | None = None,
    ) -> None:
        """Serve passes ``router_config`` (``RouterConfig``'s fields). The others stand in for
        what a Serve process finds itself, for a router driven without Ray: ``context``, the
        load tracker and model id (default: this process's for the application,
        ``cluster.router_context``);
        ``router``, the decision path (default: one over the application's index, made on
        first use); ``board``, a client of an in-flight board in this process (default: the
        index actor's, in Ray)."""
        self.config = RouterConfig(**(router_config or {}))
        self._router = router
        self.metrics = RouterMetrics() if router is None else router.metrics
        self._load_policy = make_policy(self.config)
        """Decides, with no index, until the Redis namespace (the model) is known."""
        self._router_lock = threading.Lock()
        self.context = context if context is not None else router_context(self.app_name)
        self.load: LoadTracker = self.context.load
        self.load.add_listener(self._load_changed)
        self._board = board
        """A board in this process, given (a router driven without Ray)."""
        self._mirror: ActorMirror | None = None
        """In Ray: this router's copy of the index actor's index and board (``_get_mirror``)."""
        self._publisher: ActorBoardClient | None = None
        """In Ray: shares ``load``'s snapshots with the other ingress replicas' routers."""
        self._board_lock = threading.Lock()
        self._next_metrics_log_s = time.monotonic() + METRICS_LOG_PERIOD_S
        self._removals = ThreadPoolExecutor(1, thread_name_prefix="prefixserve-index-removal")
        """Tells the index about replicas that left, off Serve's event loop (a round trip)."""
        self._stats_cache: dict[str, tuple[dict, ReplicaStats]] = {}
        """Replica id -> (the routing-stats dict Serve last handed over, it parsed)."""
        register_request_router(self)  # for cluster.metrics.router_metrics_snapshot

    # ---------------------------------------------------------------------- the decision
    def _get_router(self) -> Router | None:
        if self._router is not None:
            return self._router
        model_id = ""
        if self.config.index_backend == "redis":
            model_id = self.context.model_id
            if not model_id:
                return None  # the ingress has not named the model yet
        mirror = self._get_mirror()
        with self._router_lock:
            if self._router is None:
                if mirror is not None and mirror.index is not None:  # the embedded index
                    writer = ActorIndexClient(self.app_name, self.config)
                    index = MirroredIndex(mirror, writer)
                else:
                    index = make_cluster_index(self.app_name, self.config, model_id)
                self._router = Router(self.config, model_id, index=index, metrics=self.metrics)
        return self._router

    def _get_mirror(self) -> ActorMirror | None:
        """This router's copy of the application's index actor and its board publisher,
        created together on first use in Ray; None outside a Ray cluster or with a board
        given (nobody else to share with)."""
        if self._mirror is not None or self._board is not None or not ray.is_initialized():
            return self._mirror
        app_name = self.app_name
        with self._board_lock:
            if self._mirror is None:

                def get_actor():
                    return get_or_create_index_actor(app_name, self.config)

                board = ActorBoardClient(get_actor, self.load.snapshot, self.load.tracker_id)
                self._mirror = ActorMirror(
                    get_actor,
                    self.config,
                    self.load.tracker_id,
                    with_index=self.config.index_backend == "embedded",
                    on_peers=board.note_peers,
                )
                self._publisher = board
        return self._mirror

    def _load_changed(self) -> None:
        board = self._board if self._board is not None else self._publisher
        if board is not None:
            board.changed()

    def _peer_load(self) -> LoadSnapshot | None:
        """The other routers' requests; empty for a router outside a Serve deployment (it
        has no peers), None when the index actor's copy is stale (or the board is silent)."""
        mirror = self._get_mirror()
        if mirror is not None:
            return mirror.peers()
        return LoadSnapshot() if self._board is None else self._board.peers()

    def _views(
        self, replicas: list[RunningReplica], peers: LoadSnapshot | None = None
    ) -> list[ReplicaView]:
        """One view per replica: its routing stats and its load (``router.load``)."""
        stats = {r.replica_id.unique_id: self._parsed_stats(r) for r in replicas}
        self._stats_cache = {rid: self._stats_cache[rid] for rid in stats}
        loads = self.load.loads(stats, peers)
        return [ReplicaView(replica_id, s, loads[replica_id]) for replica_id, s in stats.items()]

    def _parsed_stats(self, replica: RunningReplica) -> ReplicaStats:
        """``replica``'s routing stats, parsed once per report: Serve replaces a replica's
        ``RunningReplicaInfo`` (and its stats dict) whenever they change, never updates it in
        place, so the same dict object means the same stats."""
        raw = replica.routing_stats or {}
        replica_id = replica.replica_id.unique_id
        cached = self._stats_cache.get(replica_id)
        if cached is not None and cached[0] is raw:
            return cached[1]
        stats = ReplicaStats.from_dict(raw)
        self._stats_cache[replica_id] = (raw, stats)
        return stats

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            ask_to_back_off(pending_request)  # else Serve retries a full set in a tight loop
        if not candidate_replicas:
            return []
        started_s, started_cpu_s = time.perf_counter(), time.thread_time()
        candidate_replicas = live_replicas(candidate_replicas)
        hashes, num_prompt_tokens = request_blocks(pending_request)
        lora_name = request_adapter(pending_request)
        router = self._get_router()
        lookup = Lookup({})
        if router is not None and hashes:  # the embedded index's copy answers without a wait
            lookup = await router.lookup_async(hashes)
        peers = self._peer_load()
        # From here to the tracker's entry nothing awaits: concurrent decisions (a burst) each
        # see the ones before them, in the views and in the router's recent decisions.
        views = self._views(candidate_replicas, peers)
        if router is None:
            decision = self._load_policy.choose(
                hashes, num_prompt_tokens, views, {}, lora_name=lora_name
            )
            self.metrics.record_decision(self.config.policy, RoutingReason.FALLBACK, len(hashes), 0)
        else:
            decision = router.decide(hashes, num_prompt_tokens, views, lookup, lora_name=lora_name)
        if pending_request is not None and hashes:  # a generate call: the order travels in it
            set_request_kwarg(pending_request, KV_PULL_KWARG, kv_pull_order(decision))
        if pending_request is not None:
            matched_tokens = decision.matched_blocks * self.config.block_size
            prefill_tokens = max(0, num_prompt_tokens - matched_tokens)
            self.load.decided(request_key(pending_request), decision.replica_id, prefill_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "routed %d blocks (adapter %s) to %s (%s, matched %d, predicted TTFT %.3f s); "
                "saw %s",
                len(hashes),
                lora_name,
                decision.replica_id,
                decision.reason,
                decision.matched_blocks,
                decision.predicted_ttft_s,
                _describe(views, lookup.matches or {}),
            )
        self.metrics.record_decision_latency(
            1000.0 * (time.perf_counter() - started_s),
            1000.0 * (time.thread_time() - started_cpu_s),
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

    # ------------------------------------------------------------------ load events
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        self.load.routed(request_key(pending_request), replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.load.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        gone = before - {rid.unique_id for rid in self.curr_replicas}
        router = self._router
        if gone and router is not None:  # their entries stop counting now, not at timeout
            for unique_id in gone:
                self._removals.submit(router.index.remove_replica, unique_id)

    def close(self) -> None:
        self.load.remove_listener(self._load_changed)
        self._removals.shutdown(wait=False)
        for shared in (self._board, self._publisher, self._mirror):
            if shared is not None:
                shared.close()
        if self._router is not None:
            self._router.close()


def _describe(views: list[ReplicaView], matches: dict) -> str:
    """What a decision saw, per replica (the debug log): its load (queued requests and their
    prefill tokens, running requests), the index's device + host blocks and the adapters in
    its device slots."""
    parts = []
    for view in views:
        load, match = view.load, matches.get(view.replica_id)
        held = "-" if match is None else f"{match.device_blocks}+{match.host_blocks}"
        adapters = ",".join(view.stats.lora_adapters) or "-"
        parts.append(
            f"{view.replica_id}: {load.num_queued}q ({load.queued_prefill_tokens} tokens) "
            f"+{load.num_running}r held {held} adapters {adapters}"
        )
    return "; ".join(parts)


def request_router_config(config: RouterConfig, stats_period_s: float) -> dict:
    """``request_router_config`` deployment option that installs this router."""
    return {
        "request_router_class": ROUTER_CLASS_PATH,
        "request_router_kwargs": {"router_config": dataclasses.asdict(config)},
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(stats_period_s, 1.0) * 5,
    }
