"""RedisIndex: the prefix index in a real Redis, shared by every router and publisher.

Owns the key layout and the Lua scripts. Keys live under
``prefixserve:v1:<model_id>:`` (hash version and model in the name, so models and hash
versions never meet); only 16-byte block hashes are stored, never prompt text:

``replicas``          hash  replica id -> liveness deadline (clock seconds)
``stream:<replica>``  hash  epoch, last seq, stale flag (``liveness.decide``'s state)
``dev:<replica>``     set   block hashes held on the device tier
``host:<replica>``    set   block hashes held on the host tier
``spec:<replica>:<n>`` set  speculative block hashes expiring in bucket ``n`` (bucket width
                            ``speculative_bucket_s``; an entry counts for at least its ttl and
                            at most one bucket longer)

A lookup is one ``EVALSHA`` round trip: the script walks the live replicas and returns, per
replica, its leading device and host block counts (``SMISMEMBER`` in doubling chunks).
``match_async`` makes that round trip on the caller's event loop (an asyncio client per
loop, made at its first lookup there), so a router's decision never waits for a worker
thread to get the GIL; ``match`` is the same lookup for synchronous callers.
Event batches are applied by a script that runs the epoch/sequence rules atomically, many
batches per pipeline. Memory is bounded: heartbeats sweep replicas past their deadline
(their keys are deleted), per-replica keys carry a TTL refreshed by heartbeats and events,
and speculative buckets expire one bucket after their last entry, so keys of a fleet that
vanished entirely expire by themselves. Scripts touch keys they derive from the namespace,
so this needs a standalone Redis (not Redis Cluster).

How it fails: lookups use a short socket timeout (writes a longer one) and no retries but
one immediate reconnect; an unreachable or stalled Redis raises ``IndexUnavailableError``
(wrap in ``index.FallbackIndex`` to route by load meanwhile). Liveness deadlines use the
callers' clocks, so routers and replicas should agree on wall time to well under
``heartbeat_timeout_s``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.retry import Retry

from router.config import redacted_url
from router.index_types import Clock, IndexUnavailableError, Match, ReplicaId
from router.liveness import ApplyOutcome
from router.protocol import HASH_NUM_BYTES, HASH_VERSION, BlockHash, EventKind, KVEventBatch, Tier
from router.redis_scripts import (
    APPLY_LUA,
    HEARTBEAT_LUA,
    MATCH_LUA,
    REMOVE_LUA,
    SPEC_BUCKETS_AHEAD,
    SPECULATIVE_LUA,
    SWEEP_LUA,
)

# Per-replica keys outlive the liveness deadline by this factor: the sweep normally deletes
# them first; the TTL only reclaims memory when no router is left to sweep.
KEY_TTL_FACTOR = 3.0
_KIND_CODES = {EventKind.STORED: "s", EventKind.REMOVED: "r", EventKind.CLEARED: "c"}
_TIER_CODES = {Tier.DEVICE: "d", Tier.HOST: "h"}
_OUTCOMES = {b"applied": ApplyOutcome.APPLIED, b"ignored": ApplyOutcome.IGNORED}
_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _joined(block_hashes: Sequence[BlockHash]) -> bytes:
    """All hashes as one argument: scripts split it, sparing the client per-argument work."""
    joined = b"".join(block_hashes)
    if len(joined) != HASH_NUM_BYTES * len(block_hashes):
        raise ValueError(f"block hashes must be {HASH_NUM_BYTES} bytes each")
    return joined


def _matches(flat: list) -> dict[ReplicaId, Match]:
    """The lookup script's flat reply (replica, device blocks, host blocks, ...) as matches."""
    return {
        flat[i].decode(): Match(device_blocks=int(flat[i + 1]), host_blocks=int(flat[i + 2]))
        for i in range(0, len(flat), 3)
    }


def namespace(model_id: str) -> str:
    """Key prefix of one model's index under the current hash version."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string")
    return f"prefixserve:{HASH_VERSION}:{model_id}:"


REDIS_PASSWORD_ENV = "PREFIXSERVE_REDIS_PASSWORD"
"""Where the password of an external Redis comes from when its URL carries none."""


class RedisIndex:
    """``PrefixIndex`` backed by Redis; safe to share between threads (pooled client)."""

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        heartbeat_timeout_s: float = 10.0,
        socket_timeout_s: float = 0.05,
        write_timeout_s: float = 1.0,
        speculative_bucket_s: float = 5.0,
        clock: Clock = time.time,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be positive, got {socket_timeout_s}")
        if speculative_bucket_s <= 0:
            raise ValueError(f"speculative_bucket_s must be positive, got {speculative_bucket_s}")
        if write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s must be positive, got {write_timeout_s}")
        self.redis_url = redis_url
        self.display_url = redacted_url(redis_url)
        """The URL for messages and logs: any password replaced by ``***``."""
        self.model_id = model_id
        self.prefix = namespace(model_id)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.socket_timeout_s = socket_timeout_s
        self.write_timeout_s = write_timeout_s
        self.speculative_bucket_s = speculative_bucket_s
        self._clock = clock
        self._key_ttl_ms = int(heartbeat_timeout_s * KEY_TTL_FACTOR * 1000)
        self._connect()

    def _client_options(self, timeout_s: float) -> dict:
        """What both kinds of client are made with."""
        # A password in the URL wins; else PREFIXSERVE_REDIS_PASSWORD (the Helm chart sets it
        # from a Secret so the password never appears in the Serve config).
        extra = {}
        if not urlparse(self.redis_url).password and os.environ.get(REDIS_PASSWORD_ENV):
            extra["password"] = os.environ[REDIS_PASSWORD_ENV]
        return dict(
            **extra,
            socket_timeout=timeout_s,
            socket_connect_timeout=self.socket_timeout_s,
            retry_on_timeout=False,
        )

    def _make_client(self, timeout_s: float) -> redis.Redis:
        return redis.Redis.from_url(
            self.redis_url,
            **self._client_options(timeout_s),
            # One immediate retry on a broken connection (a pooled socket that died with a
            # restarted server), none on timeouts: a slow Redis must fail fast.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        )

    def _async_match_script(self):
        """The lookup script on an asyncio client of the running loop, made at its first use
        there (an asyncio client belongs to the loop it was made on)."""
        loop = asyncio.get_running_loop()
        made = self._async_lookup
        if made is not None and made[0] is loop:
            return made[2]
        client = redis.asyncio.Redis.from_url(
            self.redis_url,
            **self._client_options(self.socket_timeout_s),
            retry=redis.asyncio.retry.Retry(
                NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)
            ),
        )
        script = client.register_script(MATCH_LUA)
        self._async_lookup = (loop, client, script)
        return script

    def _connect(self) -> None:
        # Lookups and speculative entries sit on the request path and get the short timeout;
        # events and heartbeats may carry a replica's whole re-announce and get a longer one.
        self._client = self._make_client(self.socket_timeout_s)
        self._writer = self._make_client(self.write_timeout_s)
        self._match = self._client.register_script(MATCH_LUA)
        self._speculative = self._client.register_script(SPECULATIVE_LUA)
        self._apply = self._writer.register_script(APPLY_LUA)
        self._heartbeat = self._writer.register_script(HEARTBEAT_LUA)
        self._sweep = self._writer.register_script(SWEEP_LUA)
        self._remove = self._writer.register_script(REMOVE_LUA)
        self._replicas_key = self.prefix + "replicas"
        self._async_lookup = None
        """(loop, asyncio client, lookup script) of the loop ``match_async`` last ran on."""

    def __getstate__(self) -> dict:
        return {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_") or k in ("_clock", "_key_ttl_ms")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._connect()

    def _unavailable(self, exc: BaseException) -> IndexUnavailableError:
        return IndexUnavailableError(
            f"redis at {self.display_url}: {exc}",
            timed_out=isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)),
        )

    def close(self) -> None:
        self._client.close()
        self._writer.close()
        made, self._async_lookup = self._async_lookup, None
        if made is not None:
            loop, client, _ = made
            if loop.is_running():  # its sockets belong to that loop: closed there
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)

    def _context(self, now: float) -> list:
        """The arguments every script starts with (see ``redis_scripts``)."""
        return [self.prefix, repr(now), repr(self.speculative_bucket_s)]

    def _run(self, script, now: float, *args):
        try:
            return script(keys=[self._replicas_key], args=[*self._context(now), *args])
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc

    # ----------------------------------------------------------------------------- events
    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self.apply_many([batch])[0]

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        if not batches:
            return []
        now = self._clock()
        context = self._context(now)
        deadline = repr(now + self.heartbeat_timeout_s)
        try:
            pipe = self._writer.pipeline(transaction=False)
            for batch in batches:
                args = [*context, batch.replica_id, batch.replica_epoch, batch.seq, deadline]
                args.append(self._key_ttl_ms)
                for event in batch.events:
                    args += [_KIND_CODES[event.kind], _TIER_CODES[event.tier]]
                    args.append(_joined(event.hashes))
                self._apply(keys=[self._replicas_key], args=args, client=pipe)
            replies = pipe.execute()
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return [_OUTCOMES.get(reply, ApplyOutcome.STALE) for reply in replies]

    # --------------------------------------------------------------------------- lookups
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        if not block_hashes:
            return {}
        return _matches(self._run(self._match, self._clock(), _joined(block_hashes)))

    async def match_async(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        """``match`` awaited on the caller's event loop."""
        if not block_hashes:
            return {}
        script = self._async_match_script()
        args = [*self._context(self._clock()), _joined(block_hashes)]
        try:
            flat = await script(keys=[self._replicas_key], args=args)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return _matches(flat)

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        """Entries count for at least ``ttl_s`` and at most one bucket width longer."""
        self.record_speculative_many([(replica_id, block_hashes)], ttl_s)

    def record_speculative_many(
        self, entries: Sequence[tuple[ReplicaId, Sequence[BlockHash]]], ttl_s: float
    ) -> None:
        """One pipeline of the speculative script, one entry per call."""
        if not 0 < ttl_s <= SPEC_BUCKETS_AHEAD * self.speculative_bucket_s:
            raise ValueError(
                f"ttl_s must be in (0, {SPEC_BUCKETS_AHEAD} * speculative_bucket_s], got {ttl_s}"
            )
        entries = [(replica_id, hashes) for replica_id, hashes in entries if hashes]
        if not entries:
            return
        context = self._context(self._clock())
        try:
            pipe = self._writer.pipeline(transaction=False)
            for replica_id, hashes in entries:
                args = [*context, replica_id, repr(ttl_s), _joined(hashes)]
                self._speculative(keys=[self._replicas_key], args=args, client=pipe)
            pipe.execute()
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc

    # -------------------------------------------------------------------------- liveness
    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        deadline = repr(now + self.heartbeat_timeout_s)
        return bool(self._run(self._heartbeat, now, replica_id, epoch, deadline, self._key_ttl_ms))

    def replicas(self) -> list[ReplicaId]:
        now = self._clock()
        try:
            deadlines = self._writer.hgetall(self._replicas_key)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return sorted(r.decode() for r, deadline in deadlines.items() if float(deadline) > now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._run(self._remove, self._clock(), replica_id)

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        removed = self._run(self._sweep, self._clock() if now is None else now)
        return sorted(r.decode() for r in removed)
