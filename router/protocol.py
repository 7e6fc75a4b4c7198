"""The contract between the engines and the router: block hashing, KV events, replica stats.

This module is the only part of ``router`` that ``worker`` may import (docs/design.md, Layout), so
it depends on nothing but the standard library and ``xxhash``.

Block hash, version 1
    Tokens are split into blocks of ``block_size`` tokens; only full blocks are hashed.
    ``seed = xxh3_128(b"prefixserve/v1\\0" + model_id + b"\\0" + cache_salt)``,
    ``h[0] = xxh3_128(seed + tokens[0:B])``, ``h[i] = xxh3_128(h[i-1] + tokens[iB:(i+1)B])``.
    Hashes are 16 big-endian bytes; tokens are little-endian uint32. Golden vectors live in
    ``tests/router/test_protocol.py``; changing any of this means a new version string.
    With an 8-bit KV cache the ``model_id`` hashed is ``cache_namespace(model_id,
    kv_cache_dtype)``: ``model_id + "\\0kv=" + kv_cache_dtype``. A request on a LoRA adapter
    hashes ``adapter_namespace(namespace, name)``: ``namespace + "\\0lora=" + name``.

KV events
    Each replica numbers its event batches with a monotonically increasing ``seq``, one batch
    per engine step that changed the cache. A consumer that sees a gap in ``seq`` (or a new
    ``replica_epoch``) must treat its view of that replica as stale and wait for the replica
    to re-announce (a ``cleared`` followed by ``stored`` of everything it holds).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

HASH_VERSION = "v1"
HASH_NUM_BYTES = 16
_SEED_PREFIX = b"prefixserve/v1\0"

BlockHash = bytes


def hash_seed(model_id: str, cache_salt: str | None = None) -> BlockHash:
    """The chain's seed: distinct models and distinct tenant salts never share a block."""
    salt = (cache_salt or "").encode()
    return xxhash.xxh3_128_digest(_SEED_PREFIX + model_id.encode() + b"\0" + salt)


def cache_namespace(model_id: str, kv_cache_dtype: str = "auto") -> str:
    """The name a block hash's seed takes for a model (``hash_blocks``' ``model_id``): the
    model id, followed by the KV format when K/V are stored in 8 bits (``kv_cache_dtype`` other
    than ``auto``), so a block stored at one precision never matches a request at another."""
    if kv_cache_dtype == "auto":
        return model_id
    return f"{model_id}\0kv={kv_cache_dtype}"


def adapter_namespace(namespace: str, lora_name: str | None) -> str:
    """The block-hash namespace of a request on LoRA adapter ``lora_name`` (None: the base
    model): the model's namespace followed by the adapter's name, so two adapters, or an
    adapter and its base, never share a block."""
    if lora_name is None:
        return namespace
    return f"{namespace}\0lora={lora_name}"


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    *,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order.

    ``parent``/``start_block`` continue a chain: pass the hash of block ``start_block - 1`` and
    the function hashes blocks ``start_block, start_block + 1, ...`` only (the engine uses this
    to hash generated tokens as blocks fill up without rehashing the prompt).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = parent if parent is not None else hash_seed(model_id, cache_salt)
    if start_block > 0 and parent is None:
        raise ValueError("start_block > 0 needs the parent hash of the block before it")
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    # Pack every token once and hash 4 * block_size byte slices: one struct.pack per call
    # instead of one per block, the same bytes.
    packed = memoryview(_pack_tokens(token_ids[start_block * block_size : num_full * block_size]))
    step = 4 * block_size
    hashes = []
    for offset in range(0, len(packed), step):
        prev = xxhash.xxh3_128_digest(prev + packed[offset : offset + step])
        hashes.append(prev)
    return hashes


class Tier(str, enum.Enum):
    """Where a cached block lives."""

    DEVICE = "device"
    HOST = "host"


class EventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True)
class KVEvent:
    """One change to a replica's cache. ``hashes`` is empty for ``cleared``."""

    kind: EventKind
    hashes: tuple[BlockHash, ...] = ()
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class KVEventBatch:
    """All cache changes of one engine step, numbered per replica."""

    replica_id: str
    seq: int
    events: tuple[KVEvent, ...]
    replica_epoch: int = 0
    """Changes when the replica's engine restarts: everything older is void."""


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica reports for routing (Ray Serve ``record_routing_stats``)."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    """Fraction of device KV blocks referenced by running requests, in [0, 1]."""
    prefill_tokens_per_s: float = 0.0
    """Measured prefill rate; 0 until the replica has measured one."""
    decode_tokens_per_s: float = 0.0
    num_queued_prefill_tokens: int = 0
    """Prompt tokens admitted or waiting whose KV is not computed yet; a waiting request's
    are counted less the prefix-cache hit the scheduler last found for it."""
    host_to_device_tokens_per_s: float = 0.0
    """Measured rate of bringing host-tier blocks back, in tokens; 0 without a host tier."""
    as_of_s: float = 0.0
    """Wall-clock time (``time.time``) up to which the counts include the requests sent to the
    replica: the start of the engine step that produced them (requests are admitted between
    steps). A router counts a request decided after it as not in these stats yet. 0: unknown
    (the router then estimates, see ``router.policy.unreported``)."""
    engine_alive: bool = True
    """False once the replica's engine died (a tensor-parallel worker lost, its process
    gone): routers send it nothing while a replica with a live engine remains, in the
    seconds before Serve's health check replaces it."""
    num_empty_kv_blocks: int = 0
    """Free device blocks that hold no cached prefix: a prefix of up to this many blocks is
    stored there without evicting one."""
    kv_lru_age: int = 0
    """Block chains the replica released (a request finished, was preempted or was not
    admitted) since its least recently used cached block was last in use: how long its cache
    keeps a prefix nobody uses, in about its own requests; 0 when no free block holds a
    prefix (and from a replica that does not say)."""
    kv_cache_dtype: str = "auto"
    """How the replica stores K/V (``EngineConfig.kv_cache_dtype``): ``auto`` (the model's
    dtype), ``int8`` or ``fp8_e4m3``. Replicas of different formats share no prefix blocks
    and pull no KV from each other. A payload without it (an older replica) reads as
    ``auto``."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters in the replica's device slots now: a request on one of them starts
    without loading it."""
    lora_load_s: float = 0.0
    """Measured seconds to put an adapter into a device slot (mean of the last loads); 0
    until the replica has loaded one."""
    num_kv_blocks: int = 0
    """Device KV blocks in all (what ``kv_usage`` is a fraction of); 0 from a replica that
    does not say: routers then price no wait for KV space there."""
    decode_s: float = 0.0
    """Measured seconds a request runs after its first token, until it finishes (a moving
    average over finished requests): how soon a running request frees its KV blocks. 0 until
    one finished."""

    def to_dict(self) -> dict:
        return {
            "engine_alive": self.engine_alive,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "kv_usage": self.kv_usage,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "num_queued_prefill_tokens": self.num_queued_prefill_tokens,
            "host_to_device_tokens_per_s": self.host_to_device_tokens_per_s,
            "as_of_s": self.as_of_s,
            "num_empty_kv_blocks": self.num_empty_kv_blocks,
            "kv_lru_age": self.kv_lru_age,
            "kv_cache_dtype": self.kv_cache_dtype,
            "lora_adapters": list(self.lora_adapters),
            "lora_load_s": self.lora_load_s,
            "num_kv_blocks": self.num_kv_blocks,
            "decode_s": self.decode_s,
        }

    def with_prefill_rate(self, tokens_per_s: float) -> ReplicaStats:
        """These stats with ``prefill_tokens_per_s`` replaced: a copy of the fields, which
        routers make for every replica on every decision (``policy.pooled_prefill_rate``),
        where ``dataclasses.replace`` costs several times more."""
        stats = object.__new__(type(self))
        stats.__dict__.update(self.__dict__)
        stats.__dict__["prefill_tokens_per_s"] = tokens_per_s
        return stats

    @classmethod
    def from_dict(cls, data: dict) -> ReplicaStats:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if "lora_adapters" in known:
            known["lora_adapters"] = tuple(known["lora_adapters"])
        return cls(**known)
