"""RedisIndex: the prefix index in a real Redis, shared by every router and publisher.

Owns the key layout and the Lua scripts. Keys live under
``prefixserve:v1:<model_id>:`` (hash version and model in the name, so models and hash
versions never meet); only 16-byte block hashes are stored, never prompt text:

``replicas``          hash  replica id -> liveness deadline (clock seconds)
``stream:<replica>``  hash  epoch, last seq, stale flag (``liveness.decide``'s state)
``dev:<replica>``     set   block hashes held on the device tier
``host:<replica>``    set   block hashes held on the host tier
``spec:<replica>``    zset  speculative block hashes, scored by expiry time

A lookup is one ``EVALSHA`` round trip: the script walks the live replicas and returns, per
replica, its leading device and host block counts (``SMISMEMBER``/``ZMSCORE`` in chunks).
Event batches are applied by a script that runs the epoch/sequence rules atomically, many
batches per pipeline. Memory is bounded: heartbeats sweep replicas past their deadline
(their keys are deleted), and every per-replica key carries a TTL refreshed by heartbeats
and events, so keys of a fleet that vanished entirely expire by themselves. Scripts touch
keys they derive from the namespace, so this needs a standalone Redis (not Redis Cluster).

How it fails: every call uses short socket timeouts and no retries; an unreachable or
stalled Redis raises ``IndexUnavailableError`` (wrap in ``index.FallbackIndex`` to route
by load meanwhile). Liveness deadlines use the callers' clocks, so routers and replicas
should agree on wall time to well under ``heartbeat_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from router.index import Clock, IndexUnavailableError, Match, ReplicaId
from router.liveness import ApplyOutcome
from router.protocol import HASH_VERSION, BlockHash, EventKind, KVEventBatch, Tier
from router.redis_scripts import APPLY_LUA, HEARTBEAT_LUA, MATCH_LUA, REMOVE_LUA, SWEEP_LUA

# Per-replica keys outlive the liveness deadline by this factor: the sweep normally deletes
# them first; the TTL only reclaims memory when no router is left to sweep.
KEY_TTL_FACTOR = 3.0
# Hashes per SADD/ZADD command: keeps each command's argument list far below Lua's stack
# limit (~8000) and Redis's per-command latency small.
WRITE_CHUNK = 1000

_KIND_CODES = {EventKind.STORED: "s", EventKind.REMOVED: "r", EventKind.CLEARED: "c"}
_TIER_CODES = {Tier.DEVICE: "d", Tier.HOST: "h"}
_OUTCOMES = {b"applied": ApplyOutcome.APPLIED, b"ignored": ApplyOutcome.IGNORED}
_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def namespace(model_id: str) -> str:
    """Key prefix of one model's index under the current hash version."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string")
    return f"prefixserve:{HASH_VERSION}:{model_id}:"


class RedisIndex:
    """``PrefixIndex`` backed by Redis; safe to share between threads (pooled client)."""

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        heartbeat_timeout_s: float = 10.0,
        socket_timeout_s: float = 0.05,
        clock: Clock = time.time,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be positive, got {socket_timeout_s}")
        self.redis_url = redis_url
        self.model_id = model_id
        self.prefix = namespace(model_id)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.socket_timeout_s = socket_timeout_s
        self._clock = clock
        self._key_ttl_ms = int(heartbeat_timeout_s * KEY_TTL_FACTOR * 1000)
        self._connect()

    def _connect(self) -> None:
        self._client = redis.Redis.from_url(
            self.redis_url,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.socket_timeout_s,
            # One immediate retry on a broken connection (a pooled socket that died with a
            # restarted server), none on timeouts: a slow Redis must fail fast.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            retry_on_timeout=False,
        )
        self._match = self._client.register_script(MATCH_LUA)
        self._apply = self._client.register_script(APPLY_LUA)
        self._heartbeat = self._client.register_script(HEARTBEAT_LUA)
        self._sweep = self._client.register_script(SWEEP_LUA)
        self._remove = self._client.register_script(REMOVE_LUA)
        self._replicas_key = self.prefix + "replicas"

    def __getstate__(self) -> dict:
        return {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_") or k in ("_clock", "_key_ttl_ms")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._connect()

    def close(self) -> None:
        self._client.close()

    def _keys(self, replica_id: ReplicaId) -> list[str]:
        return [f"{self.prefix}{kind}:{replica_id}" for kind in ("stream", "dev", "host", "spec")]

    # ----------------------------------------------------------------------------- events
    def _apply_args(self, batch: KVEventBatch, now: float) -> tuple[list, list]:
        args: list = [
            batch.replica_id,
            batch.replica_epoch,
            batch.seq,
            repr(now + self.heartbeat_timeout_s),
            self._key_ttl_ms,
        ]
        for event in batch.events:
            args += [_KIND_CODES[event.kind], _TIER_CODES[event.tier], len(event.hashes)]
            args += event.hashes
        return [self._replicas_key, *self._keys(batch.replica_id)], args

    def apply(self, batch: KVEventBatch) -> ApplyOutcome:
        return self.apply_many([batch])[0]

    def apply_many(self, batches: Sequence[KVEventBatch]) -> list[ApplyOutcome]:
        if not batches:
            return []
        now = self._clock()
        try:
            pipe = self._client.pipeline(transaction=False)
            for batch in batches:
                keys, args = self._apply_args(batch, now)
                self._apply(keys=keys, args=args, client=pipe)
            replies = pipe.execute()
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc
        return [_OUTCOMES.get(reply, ApplyOutcome.STALE) for reply in replies]

    # --------------------------------------------------------------------------- lookups
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, Match]:
        if not block_hashes:
            return {}
        args = [repr(self._clock()), self.prefix, *block_hashes]
        try:
            flat = self._match(keys=[self._replicas_key], args=args)
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc
        return {
            flat[i].decode(): Match(device_blocks=int(flat[i + 1]), host_blocks=int(flat[i + 2]))
            for i in range(0, len(flat), 3)
        }

    def record_speculative(
        self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if not block_hashes:
            return
        now = self._clock()
        key = f"{self.prefix}spec:{replica_id}"
        expiry = now + ttl_s
        try:
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(block_hashes), WRITE_CHUNK):
                chunk = block_hashes[start : start + WRITE_CHUNK]
                pipe.zadd(key, dict.fromkeys(chunk, expiry))
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.pexpire(key, self._key_ttl_ms)
            pipe.execute()
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc

    # -------------------------------------------------------------------------- liveness
    def heartbeat(self, replica_id: ReplicaId, epoch: int, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        args = [replica_id, epoch, repr(now), repr(now + self.heartbeat_timeout_s)]
        args += [self._key_ttl_ms, self.prefix]
        try:
            return bool(self._heartbeat(keys=[self._replicas_key], args=args))
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc

    def replicas(self) -> list[ReplicaId]:
        now = self._clock()
        try:
            deadlines = self._client.hgetall(self._replicas_key)
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc
        return sorted(r.decode() for r, deadline in deadlines.items() if float(deadline) > now)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        try:
            self._remove(keys=[self._replicas_key], args=[replica_id, self.prefix])
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc

    def sweep(self, now: float | None = None) -> list[ReplicaId]:
        now = self._clock() if now is None else now
        try:
            removed = self._sweep(keys=[self._replicas_key], args=[repr(now), self.prefix])
        except _UNAVAILABLE as exc:
            raise IndexUnavailableError(f"redis at {self.redis_url}: {exc}") from exc
        return sorted(r.decode() for r in removed)
