"""KV moved between replicas: ``KVPayload`` and the engine-side export and import.

A replica that lacks a prefix another replica holds can pull the blocks instead of
recomputing them. ``export_prefix`` copies the longest run of leading blocks this engine holds
(device pool or host tier) whose stored tokens match the asker's into a ``KVPayload``: the
block hashes, their tokens and the K/V of every layer, as CPU tensors in one layout whatever
the backend (``KV_LAYOUT``: ``[blocks, layers, K/V, block_size, kv_heads, head_dim]``), so a
CPU replica (head-major cache) and a CUDA one (block-major) can trade blocks. The payload
pickles (Ray's object store, an actor call's reply).

``import_prefix`` checks the payload before it touches anything: the KV format (an 8-bit
cache's payload carries its bytes and scales, ``kernels/kv_quant.py``, and is refused by an
engine at another precision, never mixed in), model id, block size, layout and shape must
equal this engine's, and the block hashes must be exactly the hash
chain of the payload's tokens under this engine's model id and the payload's cache salt
(``router/protocol.py``), else ``KVPayloadMismatchError`` (a ``ValueError``) naming the field.
Then it copies the blocks this engine does not already hold into free blocks and registers
them with ``BlockPool.cache_block``, exactly as computed blocks are: later hits compare the
stored tokens as always, and the pool's ``stored`` events announce them to the router. With
no free block left it imports the leading blocks that fit, or none; it never overwrites a
referenced block. The imported blocks end unreferenced, cached, at the young end of the
eviction queue (a chain's tail goes first, as after a request).

Tensor parallelism (each rank holds a share of the heads) is refused with a ``ValueError`` in
this first version. ``export_prefix`` and ``import_prefix`` run on the engine's own thread,
between steps: no step can write a block while it is copied. ``export_device_prefix`` is the
export a holder answers at once, on another thread while its engine steps (a busy holder's
step lasts up to seconds on a CPU): device blocks only, copied without a reference, then kept
only as far as none was evicted during the copy (``BlockPool.peek_cached_prefix``); a block
is rewritten only after it is evicted, so what is kept is what the blocks held.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from router.protocol import BlockHash, hash_blocks
from worker.block_pool import Block, BlockPool
from worker.kv_payload import (
    KV_LAYOUT,
    SHARED_KV_PREFIX,
    SHARED_KV_TTL_S,
    KVPayload,
    KVPayloadMismatchError,
    SharedKV,
    dtype_name,
    remove_shared,
)
from worker.model_runner import ModelRunner


class _Expiry:
    """Removes files at their deadlines, from one daemon thread started on first use."""

    def __init__(self) -> None:
        self._due: list[tuple[float, str]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def remove_later(self, path: str, delay_s: float) -> None:
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + delay_s, path))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="prefixserve-shared-kv-expiry", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    timeout_s = self._due[0][0] - time.monotonic() if self._due else None
                    self._wake.wait(timeout_s)
                _, path = heapq.heappop(self._due)
            remove_shared(path)


_expiry = _Expiry()


def write_shared(
    kv: torch.Tensor, directory: str, ttl_s: float = SHARED_KV_TTL_S
) -> SharedKV | None:
    """``kv`` copied into a new file under ``directory``, removed after ``ttl_s`` unless its
    importer did so first; None when the file cannot be made (no such directory, no space
    left), and the caller sends the bytes instead. The file's pages are reserved before the
    copy, so a full tmpfs fails here rather than with a SIGBUS."""
    if kv.numel() == 0:
        return None
    path = os.path.join(directory, f"{SHARED_KV_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        try:
            os.posix_fallocate(fd, 0, kv.numel() * kv.element_size())
        finally:
            os.close(fd)
        target = torch.from_file(path, shared=True, size=kv.numel(), dtype=kv.dtype)
        target.view(kv.shape).copy_(kv)
    except (OSError, RuntimeError):
        remove_shared(path)
        return None
    _expiry.remove_later(path, ttl_s)
    return SharedKV(path, dtype_name(kv.dtype), tuple(kv.shape), kv.numel() * kv.element_size())


def _refuse_tensor_parallel(runner: ModelRunner) -> None:
    if runner.comm.world_size > 1:
        raise ValueError(
            "KV transfer between replicas needs tensor_parallel_size == 1 "
            f"(this engine has {runner.comm.world_size} ranks, each holding a share of the heads)"
        )


# -- copies between the cache and the payload layout ---------------------------------------------
def gather_device_blocks(runner: ModelRunner, block_ids: Sequence[int]) -> torch.Tensor:
    """Device blocks ``block_ids`` as one CPU tensor in ``KV_LAYOUT``."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=runner.kv.device)
    if runner.ops.head_major_cache:  # kv [L, 2, Hkv, blocks, bs, D]
        out = runner.kv.index_select(3, ids).permute(3, 0, 1, 4, 2, 5)
    else:  # kv [L, 2, blocks, bs, Hkv, D]
        out = runner.kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5)
    return out.to("cpu").contiguous()


def host_slot_block(runner: ModelRunner, slot: int) -> torch.Tensor:
    """Host-tier slot ``slot`` in one block's ``KV_LAYOUT`` (``[L, 2, bs, Hkv, D]``)."""
    block = runner.host_kv[slot]
    return (
        block.transpose(2, 3) if runner.ops.head_major_cache else block
    )  # head-major slots are [L, 2, Hkv, bs, D]


def scatter_device_blocks(runner: ModelRunner, block_ids: Sequence[int], kv: torch.Tensor) -> None:
    """Writes ``kv`` (``KV_LAYOUT``, one row per id) into device blocks ``block_ids``."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=runner.kv.device)
    src = kv.to(runner.kv.device)
    if runner.ops.head_major_cache:
        runner.kv.index_copy_(3, ids, src.permute(1, 2, 4, 0, 3, 5))
    else:
        runner.kv.index_copy_(2, ids, src.permute(1, 2, 0, 3, 4, 5))


# -- export ------------------------------------------------------------------------------------
def export_prefix(
    pool: BlockPool,
    runner: ModelRunner,
    model_id: str,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    shared_dir: str | None = None,
) -> KVPayload | None:
    """The longest run of leading blocks held here (either tier) whose stored tokens equal
    ``token_ids``, as a payload; None when the first block is not held. Reads only: no
    reference, eviction order or tier changes. ``cache_salt`` rides along so the importer can
    check the hash chain (the exporter finds blocks by hash alone). With ``shared_dir`` (the
    importer is on this node) the K/V go in a ``SharedKV`` file there when one can be made."""
    _refuse_tensor_parallel(runner)
    bs = pool.block_size
    sources: list[tuple[str, int]] = []  # ("device", block_id) or ("host", slot), chain order
    for i, h in enumerate(block_hashes):
        toks = token_ids[i * bs : (i + 1) * bs]
        if len(toks) < bs:
            break
        hit = pool.find_cached_prefix([h], toks)
        if hit:
            sources.append(("device", hit[0].block_id))
            continue
        slot = (
            pool.host.slot_of(h) if pool.host is not None and pool.enable_prefix_caching else None
        )
        if slot is None or not pool.host.matches(h, toks):
            break
        sources.append(("host", slot))
    if not sources:
        return None
    device_ids = [idx for kind, idx in sources if kind == "device"]
    device_kv = gather_device_blocks(runner, device_ids) if device_ids else None
    rows, next_device = [], 0
    for kind, idx in sources:
        if kind == "device":
            rows.append(device_kv[next_device])
            next_device += 1
        else:
            rows.append(host_slot_block(runner, idx).to("cpu"))
    kv = torch.stack(rows)
    return _payload(runner, model_id, bs, block_hashes, token_ids, cache_salt, kv, shared_dir)


def export_device_prefix(
    pool: BlockPool,
    runner: ModelRunner,
    model_id: str,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    shared_dir: str | None = None,
) -> KVPayload | None:
    """``export_prefix`` of the device blocks alone, safe on any thread while the engine steps:
    the leading run of matching device blocks not evicted while they were copied; None when
    that run is empty."""
    _refuse_tensor_parallel(runner)
    hits = pool.peek_cached_prefix(block_hashes, token_ids)
    if not hits:
        return None
    kv = gather_device_blocks(runner, [block.block_id for block, _ in hits])
    n = pool.still_cached(hits)  # after the copy: a block evicted meanwhile may be rewritten
    if n == 0:
        return None
    bs = pool.block_size
    return _payload(runner, model_id, bs, block_hashes, token_ids, cache_salt, kv[:n], shared_dir)


def _payload(
    runner: ModelRunner,
    model_id: str,
    block_size: int,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    cache_salt: str | None,
    kv: torch.Tensor,
    shared_dir: str | None = None,
) -> KVPayload:
    n, spec = kv.shape[0], runner.spec
    shared = write_shared(kv.contiguous(), shared_dir) if shared_dir is not None else None
    return KVPayload(
        model_id=model_id,
        block_size=block_size,
        dtype=runner.kv_cache_dtype,
        layout=KV_LAYOUT,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        cache_salt=cache_salt,
        block_hashes=tuple(block_hashes[:n]),
        token_ids=tuple(int(t) for t in token_ids[: n * block_size]),
        kv=kv.contiguous() if shared is None else shared,
    )


# -- import ------------------------------------------------------------------------------------
def check_payload(
    payload: object, pool: BlockPool, runner: ModelRunner, model_id: str
) -> KVPayload:
    """Raises ``KVPayloadMismatchError`` naming the first field that does not fit this engine."""
    if not isinstance(payload, KVPayload):
        raise KVPayloadMismatchError(f"payload: expected a KVPayload, got {type(payload).__name__}")
    spec = runner.spec
    expected = {  # the KV format first: a peer at another precision is named as such
        "dtype": runner.kv_cache_dtype,
        "model_id": model_id,
        "block_size": pool.block_size,
        "layout": KV_LAYOUT,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
    }
    for name, want in expected.items():
        got = getattr(payload, name)
        if got != want:
            raise KVPayloadMismatchError(
                f"payload.{name}: {got!r} does not match this engine's {want!r}"
            )
    n, bs = payload.num_blocks, payload.block_size
    if len(payload.token_ids) != n * bs:
        raise KVPayloadMismatchError(
            f"payload.token_ids: {len(payload.token_ids)} tokens for {n} blocks of {bs}"
        )
    shape = (n, spec.num_layers, 2, bs, spec.num_kv_heads, runner.kv.shape[-1])
    if (
        not isinstance(payload.kv, torch.Tensor)
        or tuple(payload.kv.shape) != shape
        or payload.kv.dtype != runner.kv.dtype
    ):
        got = (
            (tuple(payload.kv.shape), payload.kv.dtype)
            if isinstance(payload.kv, torch.Tensor)
            else type(payload.kv).__name__
        )
        raise KVPayloadMismatchError(
            f"payload.kv: expected shape {shape} of {dtype_name(runner.kv.dtype)}, got {got}"
        )
    chain = hash_blocks(list(payload.token_ids), bs, model_id, payload.cache_salt)
    if tuple(chain) != tuple(payload.block_hashes):
        bad = next(
            i for i, (a, b) in enumerate(zip(chain, payload.block_hashes, strict=True)) if a != b
        )
        raise KVPayloadMismatchError(
            f"payload.token_ids: block {bad}'s tokens do not hash to payload.block_hashes[{bad}]"
        )
    return payload


def _with_kv_loaded(payload: object) -> object:
    """``payload`` with a ``SharedKV`` read into its tensor (and the file removed); anything else
    as it is. An unreadable file is a ``KVPayloadMismatchError``."""
    if not isinstance(payload, KVPayload) or not isinstance(payload.kv, SharedKV):
        return payload
    try:
        return dataclasses.replace(payload, kv=payload.kv.load())
    except (OSError, RuntimeError, ValueError) as exc:
        raise KVPayloadMismatchError(f"payload.kv: {payload.kv.path} unreadable: {exc}") from exc


def import_prefix(pool: BlockPool, runner: ModelRunner, model_id: str, payload: KVPayload) -> int:
    """Copies the payload's blocks this engine lacks into free blocks and caches them; returns
    how many were copied (0 when all are held already, or none is free). Stops at the first
    block that does not fit, or whose hash this engine caches with other tokens."""
    _refuse_tensor_parallel(runner)
    payload = check_payload(_with_kv_loaded(payload), pool, runner, model_id)
    if not pool.enable_prefix_caching or payload.num_blocks == 0:
        return 0
    bs = pool.block_size
    held: list[Block] = []  # blocks we reference, chain order: nothing can evict them meanwhile
    targets: list[tuple[Block, int]] = []  # (fresh block, payload row)
    for i, h in enumerate(payload.block_hashes):
        toks = payload.token_ids[i * bs : (i + 1) * bs]
        collisions = pool.num_collisions
        hit = pool.find_cached_prefix([h], toks)
        if hit:
            pool.touch(hit)
            held += hit
            continue
        if pool.num_collisions != collisions or pool.num_free_blocks == 0:
            break  # this hash is cached here with other tokens, or no room: keep what we have
        [block] = pool.allocate(1)  # may evict (or move to the host tier) some unreferenced block
        held.append(block)
        targets.append((block, i))
    try:
        if targets:  # a copy that raises (device memory) leaves the fresh blocks uncached and freed
            scatter_device_blocks(
                runner, [b.block_id for b, _ in targets], payload.kv[[i for _, i in targets]]
            )
            for block, i in targets:
                pool.cache_block(
                    block, payload.block_hashes[i], payload.token_ids[i * bs : (i + 1) * bs]
                )
    finally:
        pool.free(held)
    return len(targets)
