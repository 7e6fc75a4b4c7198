"""A replica's KV pulls in the request path: the router's pull order, carried out.

The request router (``cluster/request_router.py``) prices a replica that lacks a prefix a
peer holds at the pull, and when it chooses that replica it writes the order into the call's
``kv_pull`` keyword: ``{"replica_id", "peer_id", "num_blocks"}``. ``EngineReplica.generate``
hands it to ``ReplicaKVPuller.before_admission`` before the request reaches the engine, which
pulls the leading ``num_blocks`` blocks of the prompt from the peer
(``EngineReplica.pull_prefix``: the peer's ``export_prefix``, verified and imported by
``worker/kv_transfer.py``), so the request then runs as a local hit. Outputs are those of a
local hit, bitwise (determinism contract).

- The peer is named by its Serve replica id and reached directly on its actor
  (``cluster.serve_compat.peer_replica``), resolved once per peer and cached until a pull
  from it fails.
- One pull per prefix at a time: a request whose blocks a pull in flight (or finished within
  ``KV_PULL_REUSE_S``, unless it failed and the order names another peer) covers awaits that
  pull instead of starting another. A request with no
  order whose leading blocks a pull in flight brings waits for it too: after a decision with
  a pull the router's speculative entry says this replica holds the prefix, so the next
  request for it comes here with no order, and would otherwise prefill it meanwhile.
- A request waits for a pull only until its import is queued in the engine
  (``EngineReplica.pull_prefix``'s ``import_queued``), not for the import's answer: the
  engine takes commands in order, so a request added after the import finds the blocks, and
  its admission does not wait one more engine step.
- An order meant for another replica (Serve sent the call elsewhere because the chosen one
  was full) or naming this replica as the peer is ignored.

On the simulated engine (``--engine sim``) the payload holds one element per token, so it
crosses between processes in no time; ``SimulatedLink`` then makes the pulling replica wait
what the profile's ``kv_transfer_bytes_per_s`` says the real KV would take, one transfer at a
time (a link of its own per replica, as ``bench/sim/simulator.py`` models it), before the
import is queued.

How it fails: never by failing a request. A peer that is gone, holds less than the index
said, answers late (``KV_PULL_TIMEOUT_S``) or sends a payload this engine refuses costs the
pull: the request prefills what it lacks, as without pulls; the failure is logged and
counted (``kv_pull_failures_total``). Two replicas pulling from each other while both are at
``max_ongoing_requests`` wait for each other's slots until the timeout, then prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from cluster.metrics_snapshots import ReplicaMetrics
from worker.config import EngineConfig
from worker.sim_model import load_profile

log = logging.getLogger("ray.serve")

# Longest a request waits for its pull before prefilling instead. A pull takes a small
# fraction of the prefill it replaces (``python -m bench.kv_pull``); one this late means a sick
# or saturated peer, and waiting longer would cost more than the prefill it saves.
KV_PULL_TIMEOUT_S = 2.0
# A finished pull (succeeded or failed) still answers requests for its blocks this long: the
# index learns of the imported blocks within a KV-event drain or two, and until then the
# router may order the same pull again; a failed peer is not asked again on every request.
KV_PULL_REUSE_S = 2.0


class SimulatedLink:
    """A replica's incoming KV link on the simulated engine: transfers wait their turn (first
    come, first served) and then ``seconds(num_tokens)``. Runs on the replica's event loop."""

    def __init__(self, seconds: Callable[[int], float]) -> None:
        """``seconds(num_tokens)``: one transfer's time (``SimProfile.transfer_seconds``)."""
        self._seconds = seconds
        self._free_at_s = 0.0
        """``time.monotonic()`` at which the transfers already begun are through."""

    @classmethod
    def for_engine(cls, config: EngineConfig) -> SimulatedLink | None:
        """The link a replica of this engine waits on: the simulated engine's profile, or
        None for a real engine (its KV takes the time it takes)."""
        if config.engine != "sim":
            return None
        return cls(load_profile(config.sim_profile).transfer_seconds)

    async def carry(self, num_tokens: int) -> float:
        """Waits until ``num_tokens`` tokens of KV arrived; returns the seconds waited."""
        now_s = time.monotonic()
        self._free_at_s = max(now_s, self._free_at_s) + self._seconds(num_tokens)
        wait_s = self._free_at_s - now_s
        await asyncio.sleep(wait_s)
        return wait_s


def failed_pull(error: str, pull_s: float = 0.0) -> dict:
    """``EngineReplica.pull_prefix``'s result for a pull that never reached the peer."""
    return {
        "imported_blocks": 0,
        "pulled_tokens": 0,
        "payload_bytes": 0,
        "pull_s": pull_s,
        "error": error,
    }


async def _done_or_set(
    task: asyncio.Future, event: asyncio.Event, timeout_s: float | None = None
) -> None:
    """Returns once ``task`` is done or ``event`` is set (or after ``timeout_s``). Cancels
    neither: a request that gives up while waiting leaves the pull running for the others."""
    if task.done() or event.is_set():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _failed(task: asyncio.Task) -> bool:
    return task.done() and (task.cancelled() or task.result()["error"] is not None)


class ReplicaKVPuller:
    """Carries out the router's pull orders for one replica; runs on its event loop."""

    def __init__(
        self,
        replica_id: str,
        block_size: int,
        pull_prefix: Callable[..., Awaitable[dict]],
        resolve_peer: Callable[[str], object],
        metrics: ReplicaMetrics,
        timeout_s: float = KV_PULL_TIMEOUT_S,
    ) -> None:
        """``pull_prefix(peer, hashes, tokens, cache_salt)``: ``EngineReplica.pull_prefix``.
        ``resolve_peer(peer_id)``: a handle to the peer (blocking; run in a thread)."""
        self.replica_id = replica_id
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._pull_prefix = pull_prefix
        self._resolve_peer = resolve_peer
        self._peers: dict[str, object] = {}
        self._pulls: dict[bytes, asyncio.Task] = {}
        """Block hash -> the pull (in flight or recently finished) whose chain holds it."""
        self._peer_of: dict[asyncio.Task, str] = {}
        self._queued: dict[asyncio.Task, asyncio.Event] = {}
        """Pull -> set once its import is queued in the engine (requests may go ahead)."""

    def blocks_to_pull(
        self, order: dict | None, block_hashes: Sequence[bytes] | None, num_prompt_tokens: int
    ) -> int:
        """Leading blocks the order asks this replica to pull (0: ignore it)."""
        if not isinstance(order, dict) or not block_hashes:
            return 0
        if order.get("replica_id") != self.replica_id:
            return 0  # meant for the replica the router chose; Serve sent it here instead
        peer_id, num_blocks = order.get("peer_id"), order.get("num_blocks")
        if not isinstance(peer_id, str) or peer_id == self.replica_id:
            return 0
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool):
            return 0
        return max(0, min(num_blocks, len(block_hashes), num_prompt_tokens // self.block_size))

    async def before_admission(
        self,
        order: dict | None,
        block_hashes: Sequence[bytes] | None,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        lora_name: str | None = None,
    ) -> dict | None:
        """Carries out ``order`` for one request; returns once the request may be added to the
        engine: the pull has finished (its result, shared by every request it served), or its
        import is queued in the engine ahead of the request (None; the engine takes commands
        in order, so the request finds the blocks), or there was nothing to pull (None).
        Never raises but ``CancelledError`` (the request's own; the pull goes on for the
        others). ``lora_name``: the request's LoRA adapter, whose KV the peer exports (its
        block hashes are in the adapter's namespace already)."""
        num_blocks = self.blocks_to_pull(order, block_hashes, len(prompt_token_ids))
        if num_blocks == 0:  # no order; but a pull in flight may be bringing its blocks
            task = self._covering(block_hashes)
            return None if task is None else await self._admissible(task)
        hashes = [bytes(h) for h in block_hashes[:num_blocks]]
        task = self._pulls.get(hashes[-1])
        if task is not None and _failed(task) and self._peer_of.get(task) != order["peer_id"]:
            task = None  # a recent pull of these blocks failed, but from another peer: try this one
        if task is None:  # nothing in flight covers these blocks: this request pulls them
            tokens = list(prompt_token_ids[: num_blocks * self.block_size])
            queued = asyncio.Event()
            task = asyncio.get_running_loop().create_task(
                self._pull(order["peer_id"], hashes, tokens, cache_salt, queued, lora_name)
            )
            for block_hash in hashes:
                self._pulls[block_hash] = task
            self._peer_of[task] = order["peer_id"]
            self._queued[task] = queued
            task.add_done_callback(lambda done: self._forget_later(done, hashes))
        return await self._admissible(task)

    async def _admissible(self, task: asyncio.Task) -> dict | None:
        """Waits until ``task`` finished or queued its import; its result, or None."""
        queued = self._queued.get(task)
        if queued is None:
            return await asyncio.shield(task)
        await _done_or_set(task, queued)
        return task.result() if task.done() else None

    def _covering(self, block_hashes: Sequence[bytes] | None) -> asyncio.Task | None:
        """The pull in flight holding the most leading blocks of a request without an order (the
        router sent it here after another request's pull order: its speculative entry says this
        replica holds the prefix already)."""
        if not self._pulls or not block_hashes:
            return None
        for block_hash in reversed(block_hashes):
            task = self._pulls.get(bytes(block_hash))
            if task is not None:
                return None if task.done() else task
        return None

    def _forget_later(self, task: asyncio.Task, hashes: list[bytes]) -> None:
        def forget() -> None:
            for block_hash in hashes:
                if self._pulls.get(block_hash) is task:
                    del self._pulls[block_hash]
            self._peer_of.pop(task, None)
            self._queued.pop(task, None)

        asyncio.get_running_loop().call_later(KV_PULL_REUSE_S, forget)

    async def _pull(
        self,
        peer_id: str,
        hashes: list[bytes],
        tokens: list[int],
        cache_salt: str | None,
        queued: asyncio.Event,
        lora_name: str | None = None,
    ) -> dict:
        """The pull; ``timeout_s`` bounds it until its import is queued (the import's answer
        then comes within one engine step)."""
        start_s = time.monotonic()
        pull = asyncio.ensure_future(
            self._pull_from(peer_id, hashes, tokens, cache_salt, queued, lora_name)
        )
        await _done_or_set(pull, queued, self.timeout_s)
        if not pull.done() and not queued.is_set():
            pull.cancel()
            result = failed_pull(f"timed out after {self.timeout_s} s")
        else:
            try:
                result = await pull
            except Exception as exc:  # noqa: BLE001 - a bug here costs the pull, not the request
                log.exception("replica %s: KV pull from %s", self.replica_id, peer_id)
                result = failed_pull(f"{type(exc).__name__}: {exc}")
        result["pull_s"] = time.monotonic() - start_s
        self._record(peer_id, result)
        return result

    async def _pull_from(
        self,
        peer_id: str,
        hashes: list[bytes],
        tokens: list[int],
        cache_salt: str | None,
        queued: asyncio.Event,
        lora_name: str | None = None,
    ) -> dict:
        peer, resolve_s = self._peers.get(peer_id), 0.0
        if peer is None:
            start_s = time.monotonic()
            try:
                peer = await asyncio.to_thread(self._resolve_peer, peer_id)
            except Exception as exc:  # noqa: BLE001 - a peer that is gone costs the pull
                return failed_pull(f"peer {peer_id} not found: {type(exc).__name__}: {exc}")
            self._peers[peer_id] = peer
            resolve_s = time.monotonic() - start_s
        result = await self._pull_prefix(
            peer, hashes, tokens, cache_salt, import_queued=queued, lora_name=lora_name
        )
        result["resolve_s"] = resolve_s
        return result

    def _record(self, peer_id: str, result: dict) -> None:
        count = self.metrics.count
        count("kv_pulls")
        count("kv_pull_blocks", result["imported_blocks"])
        count("kv_pull_tokens", result["pulled_tokens"])
        count("kv_pull_bytes", result["payload_bytes"])
        self.metrics.observe("kv_pull_seconds", result["pull_s"])
        if result["error"] is None:
            log.debug(
                "replica %s pulled %d blocks from %s in %.3f s (peer lookup %.3f s, answer %.3f s, "
                "import %.3f s)",
                self.replica_id,
                result["imported_blocks"],
                peer_id,
                result["pull_s"],
                result.get("resolve_s", 0.0),
                result.get("export_s", 0.0),
                result.get("import_s", 0.0),
            )
            return
        count("kv_pull_failures")
        self._peers.pop(peer_id, None)  # replaced or gone: look it up again next time
        log.warning(
            "replica %s: KV pull from %s failed (%s); prefilling instead",
            self.replica_id,
            peer_id,
            result["error"],
        )
