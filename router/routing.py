"""Router: one router process's decision path (index lookup + policy + speculation + metrics).

Owns what happens per request: hash the prompt (block hash v1), one index lookup
(``lookup``), then the decision (``decide``): one measured prefill rate for the replicas
(``policy.pooled_prefill_rate``), the configured policy and, for the ``prefix``
policy, a speculative entry of the request's blocks on the chosen replica, so siblings that
arrive before its KV events still find it. ``route`` is both. The speculative write happens
off the request path by default, in one daemon thread; until it lands (and for its TTL) the
router's own ``RecentDecisions`` answers for it, merged into every lookup's matches at
decision time, so a sibling decided a moment later in the same process follows it even when
the two lookups ran concurrently. A request on a LoRA adapter (``lora_name``; its blocks
hashed in the adapter's namespace) is priced with the adapter's load on replicas without it
(``router.policy.adapter_load_s``); with the ``prefix`` policy a replica this router sent the
adapter within the speculative TTL counts as holding it (``RecentAdapters``, added to the
views' ``lora_adapters`` at decision time), so a burst of an adapter's requests gathers
rather than loading it everywhere. ``flush`` waits for pending writes and ``close`` stops the
thread. A caller that decides concurrently (the Serve request router) runs ``lookup`` off its
event loop and ``decide`` on it, so decisions see each other.

How it fails: an unavailable index (``IndexUnavailableError``) is absorbed by
``FallbackIndex``: the decision is made by load alone and its reason is ``fallback``. A
full speculative queue drops the entry (counted) rather than delay a request. An empty
candidate list raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.config import RouterConfig
from router.index import FallbackIndex, PrefixIndex, make_index
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.policy import Decision, ReplicaView, RoutingReason, pooled_prefill_rate
from router.protocol import BlockHash, adapter_namespace, hash_blocks
from router.recent_decisions import RecentAdapters, RecentDecisions, merge_matches

logger = logging.getLogger(__name__)

# Pending speculative writes beyond this are dropped: a backlog this deep means the index is
# far slower than the request rate, and entries that old would land after their siblings.
SPECULATIVE_QUEUE_SIZE = 1024
# How long the writer thread blocks on an empty queue before checking for ``close``.
WRITER_POLL_S = 0.1
# The most entries one write carries: what queued while the previous write was out goes in
# the next one (one round trip to a remote index for a burst of decisions).
SPECULATIVE_BATCH = 64
# How long the writer gathers entries after the first before it writes them: one round trip
# per this many milliseconds of decisions instead of one per decision. This router's own
# lookups see its decisions at once (``RecentDecisions``); other routers see them this much
# later, well before the replica's KV events would tell them.
SPECULATIVE_LINGER_S = 0.01


class _SpeculativeWriter:
    """Records speculative entries in a daemon thread, started on first use, in order; calls
    ``landed`` with each entry's decision number once written (or failed, or empty). Entries
    that queue within ``SPECULATIVE_LINGER_S`` of the first, or while a write is out, go
    together in the next write (``record_speculative_many``)."""

    def __init__(
        self,
        index: FallbackIndex,
        ttl_s: float,
        metrics: RouterMetrics,
        landed: Callable[[int], None],
    ) -> None:
        self._index = index
        self._ttl_s = ttl_s
        self._metrics = metrics
        self._landed = landed
        self._queue: queue.Queue = queue.Queue(maxsize=SPECULATIVE_QUEUE_SIZE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int) -> None:
        if self._stop.is_set():  # closed: nobody drains the queue any more
            self._write(replica_id, block_hashes, seq)
            return
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="prefixserve-speculative-writer", daemon=True
                    )
                    self._thread.start()
        try:
            self._queue.put_nowait((replica_id, block_hashes, seq))
        except queue.Full:
            self._metrics.record_dropped_speculation()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items = [self._queue.get(timeout=WRITER_POLL_S)]
            except queue.Empty:
                continue
            if self._queue.qsize() < SPECULATIVE_BATCH:
                self._stop.wait(SPECULATIVE_LINGER_S)
            while len(items) < SPECULATIVE_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._write_many(items)
            for _ in items:
                self._queue.task_done()

    def _write(self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int) -> None:
        self._write_many([(replica_id, block_hashes, seq)])

    def _write_many(self, items: list[tuple[str, Sequence[BlockHash], int]]) -> None:
        entries = [(replica_id, hashes) for replica_id, hashes, _ in items if hashes]
        try:
            if entries:
                self._index.record_speculative_many(entries, self._ttl_s)
        except Exception:  # a bug must not kill the thread and leave flush() hanging
            replicas = ", ".join(sorted({replica_id for replica_id, _ in entries}))
            logger.exception("speculative entry for %s failed", replicas)
        finally:
            for _, _, seq in items:
                self._landed(seq)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * WRITER_POLL_S)
        while True:  # what the thread left behind, so that flush() never waits forever
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._write(*item)
            self._queue.task_done()


@dataclass(frozen=True)
class Lookup:
    """What ``Router.lookup`` found: the index's matches (None: unreachable) and how far this
    router's speculative writes had landed when it asked (``RecentDecisions.landed_mark``)."""

    matches: dict | None
    recent_mark: int | None = None
    """None when the lookup took no mark (no blocks, or a policy that keeps no history)."""


class Router:
    """Routes requests of one model; thread-safe; wrap it in Serve's ``RequestRouter``."""

    def __init__(
        self,
        config: RouterConfig,
        model_id: str,
        index: PrefixIndex | None = None,
        metrics: RouterMetrics | None = None,
        speculate_in_background: bool = True,
    ) -> None:
        self.config = config
        self.model_id = model_id
        inner = index if index is not None else make_index(config, model_id)
        if isinstance(inner, FallbackIndex):
            self.metrics = metrics if metrics is not None else inner.metrics
            inner.metrics = self.metrics
            self.index = inner
        else:
            self.metrics = metrics if metrics is not None else RouterMetrics()
            self.index = FallbackIndex(inner, config.redis_retry_interval_s, self.metrics)
        self.policy = make_policy(config)
        self._recent = (
            RecentDecisions(config.speculative_ttl_s) if self.policy.name == "prefix" else None
        )
        self._recent_adapters = (
            RecentAdapters(config.speculative_ttl_s) if self.policy.name == "prefix" else None
        )
        self._writer = (
            _SpeculativeWriter(self.index, config.speculative_ttl_s, self.metrics, self._landed)
            if speculate_in_background
            else None
        )

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list:
        """Block hash v1 of the prompt, in ``lora_name``'s namespace (None: the base model)."""
        namespace = adapter_namespace(self.model_id, lora_name)
        return hash_blocks(token_ids, self.config.block_size, namespace, cache_salt)

    def route_tokens(
        self,
        token_ids: Sequence[int],
        replicas: Sequence[ReplicaView],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Decision:
        """Hash the prompt (block hash v1) and route it."""
        block_hashes = self.hash_prompt(token_ids, cache_salt, lora_name)
        return self.route(block_hashes, len(token_ids), replicas, lora_name=lora_name)

    def route(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        *,
        lora_name: str | None = None,
    ) -> Decision:
        """``lookup`` then ``decide``."""
        lookup = self.lookup(block_hashes)
        return self.decide(block_hashes, num_prompt_tokens, replicas, lookup, lora_name=lora_name)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        """The index's matches for the blocks (one round trip; None when it is unreachable)."""
        if not block_hashes:
            return Lookup({})
        mark = self._recent.landed_mark() if self._recent is not None else None
        start_s = time.perf_counter()
        matches = self.index.match_or_none(block_hashes)
        self.metrics.record_lookup((time.perf_counter() - start_s) * 1000.0)
        return Lookup(matches, mark)

    async def lookup_async(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        """``lookup`` awaited on the caller's event loop (``FallbackIndex.match_or_none_async``)."""
        if not block_hashes:
            return Lookup({})
        mark = self._recent.landed_mark() if self._recent is not None else None
        start_s = time.perf_counter()
        matches = await self.index.match_or_none_async(block_hashes)
        self.metrics.record_lookup((time.perf_counter() - start_s) * 1000.0)
        return Lookup(matches, mark)

    def decide(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
        lookup: Lookup,
        *,
        lora_name: str | None = None,
    ) -> Decision:
        """The policy's choice given ``lookup``'s answer (no index: by load, reason
        ``fallback``), with this router's decisions the lookup could not see merged in (the
        blocks, and the replicas sent ``lora_name`` lately) and the replicas priced at one
        prefill rate (``pooled_prefill_rate``); no I/O but the speculative write when not in
        the background."""
        replicas = pooled_prefill_rate(replicas)
        if lora_name is not None and self._recent_adapters is not None:
            replicas = with_adapter(replicas, lora_name, self._recent_adapters.holders(lora_name))
        matches = lookup.matches
        if self._recent is not None and lookup.recent_mark is not None:
            # Also when the index was unreachable: matching releases the lookup's mark.
            recent = self._recent.match(block_hashes, after=lookup.recent_mark)
            if matches is not None:
                matches = merge_matches(matches, recent)
        decision = self.policy.choose(
            block_hashes, num_prompt_tokens, replicas, matches or {}, lora_name=lora_name
        )
        if lora_name is not None and self._recent_adapters is not None:
            self._recent_adapters.record(decision.replica_id, lora_name)
        if matches is None:
            decision = dataclasses.replace(decision, reason=RoutingReason.FALLBACK)
        elif self._recent is not None and block_hashes:
            held = matches.get(decision.replica_id)
            num_held = 0 if held is None else held.device_blocks
            seq = self._recent.record(decision.replica_id, block_hashes)
            self._speculate(decision.replica_id, block_hashes[num_held:], seq)
        self.metrics.record_decision(
            self.policy.name, decision.reason, len(block_hashes), decision.matched_blocks
        )
        return decision

    def _speculate(self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """Write the entry (an empty one only marks decision ``seq`` as landed)."""
        if self._writer is not None:
            self._writer.submit(replica_id, list(block_hashes), seq)
            return
        try:
            if block_hashes:
                self.index.record_speculative(
                    replica_id, block_hashes, self.config.speculative_ttl_s
                )
        finally:
            self._landed(seq)

    def _landed(self, seq: int) -> None:
        if self._recent is not None:
            self._recent.landed(seq)

    def flush(self) -> None:
        """Wait until every speculative entry submitted so far is written."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Stop the speculative writer thread after writing what is pending."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def with_adapter(
    replicas: Sequence[ReplicaView], lora_name: str, holders: set[str]
) -> list[ReplicaView]:
    """The views with ``lora_name`` among the ``lora_adapters`` of the replicas in
    ``holders`` (sent it lately: they hold it by the time they admit the request)."""
    return [
        dataclasses.replace(
            v,
            stats=dataclasses.replace(v.stats, lora_adapters=(*v.stats.lora_adapters, lora_name)),
        )
        if v.replica_id in holders and lora_name not in v.stats.lora_adapters
        else v
        for v in replicas
    ]
