"""The embedded prefix index as one Ray actor per Serve application, and its client.

Owns where the default (``embedded``) index lives in a cluster and how routers and replicas
reach it. ``IndexActor`` hosts one embedded prefix index (``router.index_journal.
JournaledIndex``) and, with either index backend, the application's
``cluster.inflight_board.InflightBoard`` (what each request router has in flight, shared
between ingress replicas) and the record of LoRA adapters loaded or unloaded at runtime
(``cluster/lora_adapters.py``); its name is derived from the application's name
(``index_actor_name``), so two applications never
share an index and nothing uses a fixed global name. It is detached, so it outlives
whichever replica or router process created it first; every process creates it lazily
with ``get_if_exists``, and it is registered with the Serve controller so that
``serve.shutdown()`` kills it; after ``IDLE_EXIT_S`` without a live replica or a router's
report (the application was deleted) it ends itself.

``ActorIndexClient`` is a synchronous ``PrefixIndex`` over the actor, for threads that may
block (the replica's publisher thread, the speculative writer): lookups wait at most
``RouterConfig.redis_socket_timeout_s`` (at least ``MIN_ACTOR_LOOKUP_TIMEOUT_S``) and
writes ``redis_write_timeout_s``. The index is a ``router.index_journal.JournaledIndex``:
request routers read their own copy of it, and of the board, refreshed through ``sync``
(``cluster/index_mirror.py``), not the actor on every decision.

How it fails: every Ray failure (timeout, dead or unreachable actor, actor not yet created)
becomes ``IndexUnavailableError``, which ``router.index.FallbackIndex`` turns into routing
by load. A dead actor is re-created by the next call that probes it; ``generation`` then
grows, which tells a replica's publisher to re-announce everything it holds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import ray

from cluster.inflight_board import InflightBoard
from cluster.serve_compat import check_serve_internals, register_shutdown_cleanup, serve_namespace
from router.config import RouterConfig
from router.index_journal import JournalAnswer, JournaledIndex
from router.index_types import IndexUnavailableError, Match, ReplicaId
from router.liveness import ApplyOutcome
from router.load import LoadSnapshot
from router.protocol import BlockHash, KVEventBatch
from worker.cpu_claims import keep_off_claims

log = logging.getLogger("ray.serve")
check_serve_internals()  # a Ray without what serve_compat needs fails here, saying which
SERVE_NAMESPACE = serve_namespace()
"""Serve's Ray namespace: the index actor lives beside Serve's own actors."""

INDEX_ACTOR_PREFIX = "prefixserve-index:"
_CALL_FAILURES = (ray.exceptions.RayError, ValueError, TimeoutError)
"""What a call on the actor raises when the index is unavailable: Ray's errors (a timeout
among them), ``ValueError`` for an actor that was not found, and asyncio's timeout."""
# Calls are microseconds of dict work; a few threads keep one large re-announce from
# delaying every lookup behind it (EmbeddedIndex is thread-safe).
INDEX_ACTOR_MAX_CONCURRENCY = 8
# With no live replica for this long the application is gone (deleted, or its replicas
# all dead for far longer than a restart takes): the actor ends itself instead of leaking.
# A later call re-creates it, empty, and replicas re-announce.
IDLE_EXIT_S = 600.0
# Floor of the lookup timeout. A Python actor behind the GIL stalls for tens of ms now and
# then (a re-announce being applied, a GC pause, a busy CPU), and one timeout costs a whole
# ``redis_retry_interval_s`` of routing without the index; a rare 200 ms wait costs less.
MIN_ACTOR_LOOKUP_TIMEOUT_S = 0.2


def index_actor_name(app_name: str) -> str:
    """The index actor's name for one Serve application (namespace ``serve``)."""
    if not app_name:
        raise ValueError("app_name must be a non-empty string")
    return INDEX_ACTOR_PREFIX + app_name


# Without Ray's task events: routers and replicas call it tens of times a second each, and
# every call would otherwise be reported to the GCS twice (submitted, finished) for the
# state API's task list, which costs the GCS and both sides more than the call's dict work.
# Serve turns them off for its own actors the same way.
@ray.remote(num_cpus=0, max_concurrency=INDEX_ACTOR_MAX_CONCURRENCY, enable_task_events=False)
class IndexActor:
    """One embedded index (journaled, for the routers' copies) shared by every process of
    an application."""

    def __init__(self, heartbeat_timeout_s: float, idle_exit_s: float = IDLE_EXIT_S) -> None:
        keep_off_claims("index actor")
        self._index = JournaledIndex(heartbeat_timeout_s=heartbeat_timeout_s)
        self._board = InflightBoard()
        self._lora_lock = threading.Lock()
        self._lora_changes: dict[str, str | None] = {}
        self._lora_version = 0
        self._lora_epoch = uuid.uuid4().hex  # a new actor's record is a new one
        self._idle_exit_s = idle_exit_s
        threading.Thread(target=self._exit_when_idle, name="index-idle-exit", daemon=True).start()

    def _exit_when_idle(self) -> None:
        idle_since = time.monotonic()
        while True:
            time.sleep(min(self._idle_exit_s, 10.0))
            last_report_s = self._board.last_report_s
            if self._index.replicas() or (last_report_s is not None and last_report_s > idle_since):
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= self._idle_exit_s:
                log.warning("prefix index: no live replica for %.0f s, exiting", self._idle_exit_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self._index.apply(batch)

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        return self._index.apply_many(batches)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        return self._index.match(block_hashes)

    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        return self._index.heartbeat(replica_id, epoch, now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._index.remove_replica(replica_id)

    def replicas(self) -> list[ReplicaId]:
        return self._index.replicas()

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        self._index.record_speculative(replica_id, block_hashes, ttl_s)

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        self._index.record_speculative_many(entries, ttl_s)

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        return self._index.sweep(now)

    def report_inflight(
        self, router_id: str, seq: int, snapshot: LoadSnapshot, ttl_s: float
    ) -> bool:
        return self._board.report(router_id, seq, snapshot, ttl_s)

    def peer_inflight(self, router_id: str) -> LoadSnapshot:
        return self._board.peers(router_id)

    def sync(
        self, instance_id: str | None, cursor: int | None, router_id: str, with_index: bool
    ) -> tuple[JournalAnswer | None, LoadSnapshot, int]:
        """What a router's ``cluster.index_mirror.ActorMirror`` copies, in one call: the
        index's changes since ``cursor`` (``JournaledIndex.changes_since``; None without
        ``with_index``), the other routers' requests and how many other routers report."""
        answer = self._index.changes_since(instance_id, cursor) if with_index else None
        return (answer, *self._board.view(router_id))

    def lora_state(self) -> dict:
        """The runtime LoRA record: ``{"epoch", "version", "adapters": {name: path | None}}``
        (None: unloaded; ``cluster.lora_adapters.desired_adapters`` applies it)."""
        with self._lora_lock:
            return {
                "epoch": self._lora_epoch,
                "version": self._lora_version,
                "adapters": dict(self._lora_changes),
            }

    def set_lora_adapter(self, name: str, path: str | None) -> dict:
        """Records a runtime load (``path``) or unload (None); returns the new record."""
        with self._lora_lock:
            self._lora_changes[name] = path
            self._lora_version += 1
        return self.lora_state()


def get_or_create_index_actor(app_name: str, config: RouterConfig):
    """The application's index actor, created (detached) if no process has yet."""
    actor = IndexActor.options(
        name=index_actor_name(app_name),
        namespace=SERVE_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote(config.heartbeat_timeout_s)
    register_shutdown_cleanup(actor)  # a private Serve API, through serve_compat
    return actor


class ActorIndexClient:
    """Blocking ``PrefixIndex`` over the application's ``IndexActor``; thread-safe."""

    def __init__(self, app_name: str, config: RouterConfig) -> None:
        self.app_name = app_name
        self.config = config
        self.lookup_timeout_s = max(config.redis_socket_timeout_s, MIN_ACTOR_LOOKUP_TIMEOUT_S)
        self.write_timeout_s = config.redis_write_timeout_s
        self.generation = 0
        """Grows each time the client reaches a different actor (first one included)."""
        self._lock = threading.Lock()
        self._actor = None
        self._actor_id = None

    def _handle(self):
        with self._lock:
            if self._actor is None:
                actor = get_or_create_index_actor(self.app_name, self.config)
                if actor._actor_id != self._actor_id:
                    self.generation += 1
                    self._actor_id = actor._actor_id
                self._actor = actor
            return self._actor

    def _call(self, method: str, timeout_s: float, *args):
        try:
            ref = getattr(self._handle(), method).remote(*args)
            return ray.get(ref, timeout=timeout_s)
        except _CALL_FAILURES as exc:
            raise self._unavailable(method, timeout_s, exc) from exc

    def _unavailable(self, method: str, timeout_s: float, exc: Exception) -> IndexUnavailableError:
        """The ``IndexUnavailableError`` a failed call stands for; a dead or missing actor is
        resolved (and maybe re-created) on the next call."""
        if isinstance(exc, TimeoutError):  # ray.get's GetTimeoutError or asyncio's
            return IndexUnavailableError(
                f"index actor {method} took over {timeout_s}s", timed_out=True
            )
        if isinstance(exc, ray.exceptions.RayActorError | ValueError):
            with self._lock:
                self._actor = None
            return IndexUnavailableError(f"index actor unreachable: {exc!r}")
        return IndexUnavailableError(f"index actor call failed: {exc!r}")

    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self._call("apply", self.write_timeout_s, batch)

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        return self._call("apply_many", self.write_timeout_s, list(batches))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        return self._call("match", self.lookup_timeout_s, list(block_hashes))

    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        return self._call("heartbeat", self.write_timeout_s, replica_id, epoch, now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._call("remove_replica", self.write_timeout_s, replica_id)

    def replicas(self) -> list[ReplicaId]:
        return self._call("replicas", self.write_timeout_s)

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        self._call(
            "record_speculative", self.write_timeout_s, replica_id, list(block_hashes), ttl_s
        )

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        entries = [(replica_id, list(hashes)) for replica_id, hashes in entries]
        self._call("record_speculative_many", self.write_timeout_s, entries, ttl_s)

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        return self._call("sweep", self.write_timeout_s, now)


def make_cluster_index(app_name: str, config: RouterConfig, model_id: str):
    """The backend ``config.index_backend`` names, reachable from any process of the app."""
    if config.index_backend == "redis":
        from router.index import make_index

        return make_index(config, model_id)
    return ActorIndexClient(app_name, config)
