"""The engine-replica deployment: one ``AsyncEngine`` per Serve replica, streamed over handles.

``EngineReplica.generate`` is an async generator called through a streaming
``DeploymentHandle``; it relays the engine's ``OutputDelta``s (``worker/outputs.py``: what
each step added, nothing else) as the engine made them, stamping each with its number in the
stream (``seq``) and this replica's id; with ``stream_interval`` above 1 it first joins
consecutive ones. With ``push_to`` (the calling ingress replica) every output but the last
goes to that ingress through an ``IngressChannel`` (``cluster/ingress_channel.py``: every
request's outputs of an engine step in one frame on a connection of its own,
``cluster/push_socket.py``), the first included, so a step's first tokens reach the ingress
in one frame; the call yields only the last, once the pushed ones arrived, so the handle
stream's end follows every output. Without ``push_to``, or once the channel broke, it
yields them all. The replica times the engine-side phases from the timestamps in the first
and last delta (``cluster.metrics_snapshots.ReplicaMetrics``). A request the engine refuses
(bad input, full queue, dead engine) yields one ``cluster.stream_items.Rejected`` instead of
raising, so the ingress maps it to 400/429/503 without unpickling engine errors.

``export_prefix`` and ``pull_prefix`` move a prefix's KV between replicas
(``worker/kv_transfer.py``): the puller asks a peer for the blocks it holds and imports them
into its own cache; a failed pull is logged and returns zero blocks, never failing a request.
``generate``'s ``kv_pull`` keyword (the request router's order) makes the replica pull before
the request reaches the engine (``cluster/kv_pull.py``), so it runs as a local hit.

When the caller goes away (client disconnect -> Serve cancels the child request) the
generator is cancelled or closed inside ``engine.generate``, which aborts the request and
frees its blocks. ``check_health`` fails once the engine loop is dead or, under tensor
parallelism, once any worker rank has ended (``cluster/tp_workers.py``), so Serve replaces
the replica; ``__del__`` (Serve's graceful shutdown, after in-flight requests drained or the
grace period ran out) ends what is left with ``finish_reason="abort"`` and stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time

import ray
from ray import serve

from cluster.gc_tuning import collect_young_less_often
from cluster.index_actor import make_cluster_index
from cluster.ingress_channel import IngressChannels
from cluster.kv_publisher import ReplicaKVPublisher
from cluster.kv_pull import ReplicaKVPuller, SimulatedLink
from cluster.lora_adapters import AdapterRecord, ReplicaAdapterSync, replica_result
from cluster.metrics import push_snapshots_forever
from cluster.metrics_snapshots import ReplicaMetrics
from cluster.push_socket import PushConnection
from cluster.serve_compat import peer_replica
from cluster.stream_items import Rejected, RejectKind
from router.config import RouterConfig
from worker import AsyncEngine, EngineConfig, SamplingParams
from worker.cpu_claims import keep_off_claims
from worker.kv_payload import default_shared_dir
from worker.metrics import lora_requests_of
from worker.outputs import EngineDeadError, EngineOverloadedError, OutputDelta

# Serve routes the "ray.serve" logger into each replica's log file.
log = logging.getLogger("ray.serve")

# How long __del__ lets running requests finish before aborting them: short, because Serve
# only calls it after its own drain (graceful_shutdown_timeout_s) and then kills the actor.
SHUTDOWN_DRAIN_S = 2.0
# How often a draining replica checks whether its last requests finished on their own.
DRAIN_POLL_S = 0.1


async def _deliver_to(address: dict):
    """A connection to the push server of the ingress replica at ``address``: its ``send``."""
    return (await PushConnection.open(address)).send


class _StreamState:
    """What ``EngineReplica.generate`` keeps of one request's stream: shared by the call's
    own loop and by the sink its pushed outputs go through (``EngineReplica._push``)."""

    __slots__ = ("last_step_s", "pending", "seq")

    def __init__(self) -> None:
        self.last_step_s: float | None = None
        """When the last output arrived (None before the first)."""
        self.pending: OutputDelta | None = None
        """Outputs held back to send ``stream_interval`` tokens at once."""
        self.seq = 0
        """The number the next output sent gets."""


@serve.deployment
class EngineReplica:
    """One engine; Serve runs ``num_replicas`` of these behind the ingress's handle."""

    node_id: str | None = None
    """The Ray node this replica runs on: a peer on the same node is sent K/V through shared
    memory (``kv_transfer.SharedKV``) instead of in the reply."""

    async def __init__(
        self,
        engine_config: dict,
        metrics_hub=None,
        model_name: str = "",
        router_config: dict | None = None,
        stream_interval: int = 1,
    ) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        config = EngineConfig(**engine_config)
        launcher = None
        if config.tensor_parallel_size > 1:  # torch loads here only with tensor parallelism
            from cluster.tp_workers import RayWorkerLauncher

            launcher = RayWorkerLauncher()
        self.engine = AsyncEngine(config, replica_id=self.replica_id, launcher=launcher)
        keep_off_claims("engine replica")  # its relays leave the engines' claimed CPUs alone
        self.model_name = model_name or self.engine.model_id
        self.stream_interval = stream_interval
        self.metrics = ReplicaMetrics()
        self._hub = metrics_hub
        self._in_flight: set[str] = set()
        self._drain_task: asyncio.Task | None = None
        self._push_task = asyncio.get_running_loop().create_task(self._push_metrics_forever())
        self._kv_link = SimulatedLink.for_engine(config)
        self.kv_puller = ReplicaKVPuller(
            self.replica_id,
            self.engine.block_size,
            self.pull_prefix,
            lambda peer_id: peer_replica(context.replica_id, peer_id),
            self.metrics,
        )
        self._channels = IngressChannels(_deliver_to)
        self._kv_publisher = None
        self._lora_task: asyncio.Task | None = None
        if router_config is not None and config.enable_lora:
            # Adapters loaded at runtime before this replica started, before it serves.
            sync = ReplicaAdapterSync(
                self.replica_id,
                config.lora_modules,
                AdapterRecord(context.app_name, RouterConfig(**router_config)).read,
                self.engine.lora_adapters,
                self.engine.load_lora_adapter,
                self.engine.unload_lora_adapter,
            )
            await sync.sync()
            self._lora_task = asyncio.get_running_loop().create_task(sync.run_forever())
        if router_config is not None:  # KV events and heartbeats to the prefix index
            router = RouterConfig(**router_config)
            self._kv_publisher = ReplicaKVPublisher(
                self.engine.drain_kv_events,
                make_cluster_index(context.app_name, router, self.engine.model_id),
                self.replica_id,
                heartbeat_timeout_s=router.heartbeat_timeout_s,
                retry_interval_s=router.redis_retry_interval_s,
            )
            self._kv_publisher.start()
        collect_young_less_often(f"replica {self.replica_id}")
        log.info("replica %s serving %s", self.replica_id, self.engine.model_id)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        block_hashes: list[bytes] | None = None,
        resume_token_ids: list[int] | None = None,
        kv_pull: dict | None = None,
        push_to: dict | None = None,
        lora_name: str | None = None,
    ):
        """Streams the request's ``OutputDelta``s, each numbered (``seq``), or one
        ``Rejected``. ``block_hashes``
        are for the router (and a pull); ``resume_token_ids`` continue a stream a dead replica
        began (the ingress's failover); ``kv_pull``: the request router's order to pull leading
        blocks from a peer first (``cluster.request_router.kv_pull_order``), set by the router,
        not the caller; ``push_to``: the calling ingress replica's push address
        (``cluster.push_socket.PushServer.address`` and its ``replica_id``): every output but
        the last goes to it through its ``IngressChannel`` instead of this call
        (``cluster/ingress_channel.py``), and this call yields the last (or the rejection)
        once they arrived;
        ``lora_name``: the LoRA adapter the request runs on (None: the base model; one this
        engine does not know is an ``INVALID`` rejection)."""
        state = _StreamState()
        channel = None
        self._in_flight.add(request_id)
        try:
            if block_hashes:  # never raises: a failed pull means a prefill
                await self.kv_puller.before_admission(
                    kv_pull, block_hashes, prompt_token_ids, cache_salt, lora_name
                )
            if push_to is not None:
                channel = await self._channels.get(push_to)
            stream = self.engine.generate(
                request_id,
                prompt_token_ids,
                params,
                cache_salt=cache_salt,
                resume_token_ids=resume_token_ids or (),
                lora_name=lora_name,
                # Every output but the last goes to the channel from the step's callback.
                sink=None if channel is None else functools.partial(self._push, state, channel),
            )
            async with contextlib.aclosing(stream):
                async for out in stream:  # the last output, or all once the channel broke
                    item = self._take(state, out)
                    if item is None:  # held back: stream_interval tokens not reached
                        continue
                    if channel is not None:
                        await channel.flushed()  # what was pushed arrives first
                    yield item
        except ValueError as exc:
            if lora_name is not None and lora_name not in await self._lora_names():
                yield await self._after_pushes(channel, RejectKind.UNKNOWN_MODEL, lora_name)
            else:
                yield await self._after_pushes(channel, RejectKind.INVALID, str(exc))
        except EngineOverloadedError as exc:
            yield await self._after_pushes(channel, RejectKind.OVERLOADED, str(exc) or "queue full")
        except EngineDeadError as exc:
            yield await self._after_pushes(channel, RejectKind.DEAD, str(exc) or "engine loop died")
        except Exception as exc:  # an engine bug fails this request only, visibly
            log.exception("request %s failed", request_id)
            yield await self._after_pushes(
                channel, RejectKind.INTERNAL, f"{type(exc).__name__}: {exc}"
            )
        finally:
            self._in_flight.discard(request_id)

    async def _lora_names(self) -> dict[str, str]:
        """The adapters the engine serves; empty when it cannot say (a dead engine)."""
        try:
            return await self.engine.lora_adapters()
        except Exception:  # noqa: BLE001 - only tells a refusal's kind apart
            return {}

    async def _after_pushes(self, channel, kind: RejectKind, message: str) -> Rejected:
        """The rejection to stream, once what was pushed for the request has arrived."""
        if channel is not None:
            await channel.flushed()
        return Rejected(kind, message, self.replica_id)

    def _take(self, state: _StreamState, out: OutputDelta) -> OutputDelta | None:
        """The delta to send for ``out`` (numbered, joined to what was held back before
        it), or None while ``stream_interval`` holds it back; records the engine-side
        histograms."""
        now_s = time.monotonic()
        self._observe(out, now_s, state.last_step_s)
        is_first = state.last_step_s is None
        state.last_step_s = now_s
        pending = out if state.pending is None else state.pending.extend(out)
        if not is_first and not self._due(pending):
            state.pending = pending
            return None
        state.pending = None
        pending.seq, pending.replica_id = state.seq, self.replica_id
        state.seq += 1
        return pending

    def _push(self, state: _StreamState, channel, out: OutputDelta) -> bool:
        """``AsyncEngine.generate``'s sink for a request whose outputs go to ``channel``:
        False once the channel broke (the output then streams through the handle call)."""
        if channel.broken:
            return False
        item = self._take(state, out)
        if item is not None:
            channel.push(item)
        return True

    def _due(self, pending: OutputDelta) -> bool:
        """Whether held-back outputs go now: the request ended, or a choice ended or has
        ``stream_interval`` new tokens."""
        if pending.finished:
            return True
        return any(
            c.finish_reason is not None or len(c.new_token_ids) >= self.stream_interval
            for c in pending.choices
        )

    def _observe(self, out: OutputDelta, now_s: float, last_step_s: float | None) -> None:
        """Engine-side histograms from the engine's timestamps (a missing arrival, first token
        or finish reads as now; without a first scheduling the phases it starts are skipped).
        Between the first output and the last: one clock difference per output."""
        observe = self.metrics.observe
        if last_step_s is not None:
            observe("inter_token_latency_seconds", now_s - last_step_s)
            if not out.finished:
                return
        times = out.metrics or {}
        arrival_s = times.get("arrival_time") or now_s
        scheduled_s = times.get("first_scheduled_time")
        first_token_s = times.get("first_token_time")
        if last_step_s is None:
            observe("engine_time_to_first_token_seconds", (first_token_s or now_s) - arrival_s)
            if scheduled_s is not None:
                observe("engine_queue_time_seconds", scheduled_s - arrival_s)
        if out.finished:  # the phases count once, at the finish, as in vLLM
            finished_s = times.get("finished_time") or now_s
            observe("engine_e2e_request_latency_seconds", finished_s - arrival_s)
            if first_token_s is not None:
                observe("request_decode_time_seconds", finished_s - first_token_s)
            if scheduled_s is not None:
                observe("request_inference_time_seconds", finished_s - scheduled_s)
                if first_token_s is not None:
                    observe("request_prefill_time_seconds", first_token_s - scheduled_s)

    async def check_health(self) -> None:
        """Serve's health probe: raising marks this replica unhealthy and replaces it. A
        coroutine, as ``record_routing_stats``: Serve runs a plain method on a worker thread
        (one hop there and back per call, on every replica, all the time); this one only
        reads state."""
        if not self.engine.is_alive():
            raise RuntimeError(
                f"engine of replica {self.replica_id} is dead: {self.engine.why_dead()}"
            )

    async def record_routing_stats(self) -> dict:
        """Serve's routing-stats hook: what the request router reads per replica, with
        whether the engine is alive (``ReplicaStats.engine_alive``): routers skip a replica
        whose engine died (a tensor-parallel worker lost) in the seconds before the health
        check has Serve replace it (the ingress re-submits what it sent there). Called every
        ``ROUTING_STATS_PERIOD_S`` (``cluster/app.py``); a coroutine for the reason
        ``check_health`` gives."""
        stats = dataclasses.replace(self.engine.stats(), engine_alive=self.engine.is_alive())
        return stats.to_dict()

    def drain_kv_events(self) -> list:
        """KV event batches since the last call (``router.protocol.KVEventBatch``)."""
        return self.engine.drain_kv_events()

    def metrics_snapshot(self) -> dict:
        """The hub's snapshot: the engine's gauges and counters, the replica's histograms,
        its KV cache configuration (``cache_config_info``'s labels) and, with LoRA on, the
        adapters its requests run on (``lora_requests_info``'s labels, as vLLM's)."""
        config = self.engine.config
        engine_metrics = self.engine.metrics()
        info = {
            "cache_config_info": {
                "block_size": str(config.block_size),
                "kv_cache_dtype": config.kv_cache_dtype,
            }
        }
        if config.enable_lora:
            running, waiting = lora_requests_of(engine_metrics)
            info["lora_requests_info"] = {
                "running_lora_adapters": ",".join(running),
                "waiting_lora_adapters": ",".join(waiting),
                "max_lora": str(config.max_loras),
            }
        return self.metrics.snapshot(
            engine_metrics,
            alive=self.engine.is_alive(),
            model_name=self.model_name,
            info=info,
        )

    async def export_prefix(
        self,
        block_hashes: list[bytes],
        token_ids: list[int],
        cache_salt: str | None = None,
        peer_node_id: str | None = None,
        lora_name: str | None = None,
    ):
        """The leading blocks of this prefix that this replica holds, as a ``KVPayload`` (None
        when it holds none): what a peer's ``pull_prefix`` calls. A peer on this
        node (``peer_node_id``) gets the K/V in a shared-memory file, removed by its import or
        after ``worker.kv_transfer.SHARED_KV_TTL_S``. ``lora_name``: the adapter whose KV it
        is (its blocks are cached under the adapter's namespace)."""
        start_s = time.monotonic()
        shared_dir = None
        if peer_node_id is not None and peer_node_id == self.node_id:
            shared_dir = default_shared_dir()
        payload = await self.engine.export_prefix(
            block_hashes, token_ids, cache_salt, shared_dir, lora_name=lora_name
        )
        log.debug(
            "replica %s exported %d blocks in %.3f s",
            self.replica_id,
            0 if payload is None else payload.num_blocks,
            time.monotonic() - start_s,
        )
        return payload

    async def pull_prefix(
        self,
        peer,
        block_hashes: list[bytes],
        token_ids: list[int],
        cache_salt: str | None = None,
        import_queued: asyncio.Event | None = None,
        lora_name: str | None = None,
    ) -> dict:
        """Copies the blocks of this prefix that ``peer`` holds into this replica's cache, so
        the next request with it hits them instead of prefilling. ``peer``: a handle whose
        ``export_prefix.remote(...)`` is awaitable (a Serve handle pinned to the holder, a Ray
        actor handle). Never raises: a peer that is gone, holds nothing or sends a payload
        this engine refuses costs the pull, not a request; ``error`` says why.
        Returns ``{"imported_blocks", "pulled_tokens", "payload_bytes", "pull_s", "error"}``,
        ``export_s`` (the peer's answer arrived after this long; on the simulated engine, its
        KV too, ``cluster.kv_pull.SimulatedLink``) once it answered and
        ``import_s`` (this engine took the blocks after this much longer) once imported.
        ``import_queued`` is set once the import is queued in the engine: a request added from
        then on finds the blocks, so it need not wait for the import's answer. ``lora_name``:
        the adapter whose KV to pull (the peer exports it under the adapter's namespace)."""
        t0 = time.monotonic()
        result = {
            "imported_blocks": 0,
            "pulled_tokens": 0,
            "payload_bytes": 0,
            "pull_s": 0.0,
            "error": None,
        }
        try:
            payload = await peer.export_prefix.remote(
                block_hashes, token_ids, cache_salt, self.node_id, lora_name
            )
            if payload is not None and self._kv_link is not None:
                await self._kv_link.carry(payload.num_tokens)
            result["export_s"] = time.monotonic() - t0
            if payload is not None:
                result["pulled_tokens"], result["payload_bytes"] = (
                    payload.num_tokens,
                    payload.kv_bytes,
                )
                imported = self.engine.submit_import(payload)
                if import_queued is not None:
                    import_queued.set()
                result["imported_blocks"] = await imported
                result["import_s"] = time.monotonic() - t0 - result["export_s"]
        except Exception as exc:  # noqa: BLE001 - a failed pull falls back to prefilling
            log.warning("replica %s: pulling a prefix from a peer failed: %r", self.replica_id, exc)
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["pull_s"] = time.monotonic() - t0
        return result

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Loads LoRA adapter ``name`` from the folder ``path`` into this replica's engine
        (the ingress's ``/v1/load_lora_adapter``, called on this replica's actor). Never
        raises: ``cluster.lora_adapters.replica_result`` with 400 and the engine's message for
        a folder it refuses (or LoRA off, or tensor parallelism)."""
        try:
            await self.engine.load_lora_adapter(name, path)
        except ValueError as exc:
            return replica_result(self.replica_id, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 - a dead engine answers, never raises
            log.warning("replica %s: loading LoRA adapter %r failed", self.replica_id, name)
            return replica_result(self.replica_id, 503, f"{type(exc).__name__}: {exc}")
        log.info("replica %s: loaded LoRA adapter %r from %s", self.replica_id, name, path)
        return replica_result(self.replica_id)

    async def unload_lora_adapter(self, name: str) -> dict:
        """Unloads LoRA adapter ``name`` (``/v1/unload_lora_adapter``). Never raises: 404 for
        an adapter this engine does not serve, 409 while requests on it are queued or running,
        400 under tensor parallelism."""
        try:
            await self.engine.unload_lora_adapter(name)
        except KeyError:
            return replica_result(self.replica_id, 404, f"no LoRA adapter named {name!r}")
        except ValueError as exc:
            status = 400 if self.engine.config.tensor_parallel_size > 1 else 409
            return replica_result(self.replica_id, status, str(exc))
        except Exception as exc:  # noqa: BLE001 - a dead engine answers, never raises
            log.warning("replica %s: unloading LoRA adapter %r failed", self.replica_id, name)
            return replica_result(self.replica_id, 503, f"{type(exc).__name__}: {exc}")
        log.info("replica %s: unloaded LoRA adapter %r", self.replica_id, name)
        return replica_result(self.replica_id)

    def describe(self) -> dict:
        """What the ingress must agree on with the engine: names, limits, block size."""
        return {
            "replica_id": self.replica_id,
            "model_id": self.engine.model_id,
            "cache_namespace": self.engine.cache_namespace,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
            "vocab_size": self.engine.tokenizer_vocab_size,
            "tokenizer_class": self.engine.tokenizer_class,
        }

    async def _push_metrics_forever(self) -> None:
        """The metrics snapshot to the hub (``push_snapshots_forever``: an idle replica's
        pushes are most of its idle calls)."""
        if self._hub is None:
            return
        await push_snapshots_forever(
            lambda snapshot: self._hub.report.remote(self.replica_id, snapshot),
            self.metrics_snapshot,
            "replica",
        )

    async def begin_drain(self, grace_s: float) -> None:
        """The drain order of ``prefixserve serve`` (Ctrl-C, SIGTERM), called on this
        replica's actor: requests in flight may finish for ``grace_s``, then the rest are
        aborted (``_end_in_flight``). Serve gives user code no signal before it drains a
        replica, hence the call. A second order while draining changes nothing. A coroutine,
        so Serve runs it on the replica's loop (a plain method runs in a worker thread)."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._end_in_flight(grace_s))

    async def _end_in_flight(self, grace_s: float) -> None:
        """Let requests finish for ``grace_s``, then abort the rest, so their streams end
        with finish_reason "abort" instead of being cut when Serve kills us."""
        deadline_s = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
        for request_id in list(self._in_flight):
            self.engine.abort(request_id)

    async def __del__(self) -> None:
        if not hasattr(self, "_push_task"):  # __init__ failed (the engine did not start)
            return
        self._push_task.cancel()
        if getattr(self, "_lora_task", None) is not None:
            self._lora_task.cancel()
        self._channels.close()
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self._kv_publisher is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv_publisher.close(), 2.0)
        if self._hub is not None:
            with contextlib.suppress(Exception):
                snapshot = self.metrics_snapshot()
                snapshot["alive"] = False
                await asyncio.wait_for(self._hub.report.remote(self.replica_id, snapshot), 1.0)
        await self.engine.shutdown(drain_timeout_s=SHUTDOWN_DRAIN_S)
