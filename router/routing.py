"""Router: one router process's decision path (index lookup + policy + speculation + metrics).

Owns what happens per request: hash the prompt (block hash v1), one index lookup, the
configured policy, then for the ``prefix`` policy a speculative entry of the request's
blocks on the chosen replica, so siblings that arrive before its KV events still find it.
The speculative write happens off the request path by default, in one daemon thread (a
sibling arriving within that write's round trip misses it, events arrive a step later
anyway); ``flush`` waits for pending writes and ``close`` stops the thread.

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
from collections.abc import Sequence

from router.config import RouterConfig
from router.index import FallbackIndex, PrefixIndex, make_index
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.policy import Decision, ReplicaView, RoutingReason
from router.protocol import BlockHash, hash_blocks

logger = logging.getLogger(__name__)

# Pending speculative writes beyond this are dropped: a backlog this deep means the index is
# far slower than the request rate, and entries that old would land after their siblings.
SPECULATIVE_QUEUE_SIZE = 1024
# How long the writer thread blocks on an empty queue before checking for ``close``.
WRITER_POLL_S = 0.1


class _SpeculativeWriter:
    """Records speculative entries in a daemon thread, started on first use."""

    def __init__(self, index: FallbackIndex, ttl_s: float, metrics: RouterMetrics) -> None:
        self._index = index
        self._ttl_s = ttl_s
        self._metrics = metrics
        self._queue: queue.Queue = queue.Queue(maxsize=SPECULATIVE_QUEUE_SIZE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        if self._stop.is_set():  # closed: nobody drains the queue any more
            self._index.record_speculative(replica_id, block_hashes, self._ttl_s)
            return
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="prefixserve-speculative-writer", daemon=True
                    )
                    self._thread.start()
        try:
            self._queue.put_nowait((replica_id, block_hashes))
        except queue.Full:
            self._metrics.record_dropped_speculation()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=WRITER_POLL_S)
            except queue.Empty:
                continue
            self._write(*item)

    def _write(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        try:
            self._index.record_speculative(replica_id, block_hashes, self._ttl_s)
        except Exception:  # a bug must not kill the thread and leave flush() hanging
            logger.exception("speculative entry for %s failed", replica_id)
        finally:
            self._queue.task_done()

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
        self._writer = (
            _SpeculativeWriter(self.index, config.speculative_ttl_s, self.metrics)
            if speculate_in_background
            else None
        )

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list:
        return hash_blocks(token_ids, self.config.block_size, self.model_id, cache_salt)

    def route_tokens(
        self,
        token_ids: Sequence[int],
        replicas: Sequence[ReplicaView],
        cache_salt: str | None = None,
    ) -> Decision:
        """Hash the prompt (block hash v1) and route it."""
        return self.route(self.hash_prompt(token_ids, cache_salt), len(token_ids), replicas)

    def route(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        replicas: Sequence[ReplicaView],
    ) -> Decision:
        matches: dict | None = {}
        if block_hashes:
            start_s = time.perf_counter()
            matches = self.index.match_or_none(block_hashes)
            self.metrics.record_lookup((time.perf_counter() - start_s) * 1000.0)
        decision = self.policy.choose(block_hashes, num_prompt_tokens, replicas, matches or {})
        if matches is None:
            decision = dataclasses.replace(decision, reason=RoutingReason.FALLBACK)
        elif self.policy.name == "prefix" and block_hashes:
            held = matches.get(decision.replica_id)
            num_held = 0 if held is None else held.device_blocks
            if num_held < len(block_hashes):
                self._speculate(decision.replica_id, block_hashes[num_held:])
        self.metrics.record_decision(
            self.policy.name, decision.reason, len(block_hashes), decision.matched_blocks
        )
        return decision

    def _speculate(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        if self._writer is None:
            self.index.record_speculative(replica_id, block_hashes, self.config.speculative_ttl_s)
        else:
            self._writer.submit(replica_id, list(block_hashes))

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
