"""LoRA adapters across the cluster: which names a request's ``model`` may take, their model
cards, and loading or unloading one at runtime on every engine replica.

The adapters an application serves are its engines' ``lora_modules`` (every replica loads them
at start) changed by the runtime loads and unloads recorded in the application's
``IndexActor`` (``cluster/index_actor.py``): ``{name: path}`` for a load, ``{name: None}`` for
an unload, with a version that grows on each change and an epoch that is new for each actor
(``desired_adapters`` merges the two). Three parties read them:

- the ingress's ``AdapterCatalog``, which answers whether a ``model`` names an adapter. It
  re-reads the record when a name is unknown (concurrent misses share one read, so a flood of
  unknown names costs one actor call at a time) and in the background once its copy is
  ``CATALOG_TTL_S`` old, so an adapter another ingress replica loaded is found at once and one
  it unloaded is forgotten within seconds (a request that slips through meanwhile gets the
  replica's 404, ``RejectKind.UNKNOWN_MODEL``);
- the load and unload endpoints (``load_everywhere``, ``unload_everywhere``, called by
  ``cluster/ingress.py``), which call the engine replicas that report to the metrics hub
  directly on their actors (``call_every_replica``) and record the
  change only once every replica that answered took it: a load one replica refuses (400, the
  engine's message naming the folder) is unloaded again from the others, and an unload one
  replica refuses because requests use the adapter (409) is loaded again on the others. A
  replica that does not answer (gone, or slower than ``ADMIN_CALL_TIMEOUT_S``) does not block
  the change; it catches up through its sync;
- each engine replica's ``ReplicaAdapterSync``, which brings its engine to the record at start
  (before it serves) and then every ``SYNC_PERIOD_S`` once the version or epoch moved: a replica
  started later (restart, scale-up) serves what was loaded at runtime, and one that missed a
  change converges. It unloads only what the record unloads or replaces (an adapter it does
  not name may be a load the ingress has not recorded yet). An unload refused because a
  request still uses the adapter is retried on the next period; a folder the engine refuses
  is logged once per record.

How it fails: with the index actor unreachable the catalog keeps its last copy, a replica
keeps its adapters until the actor answers again, and a load or unload answers 503 after the
running replicas took it (the message says so; the same call again completes it: a repeated
load of the same folder is a no-op in the engine). The record lives in the actor's memory: an
actor that ends (the application was deleted, or it had no live replica for ``IDLE_EXIT_S``)
forgets the runtime loads, so the ingresses stop accepting their names and replicas started
later do not load them (load them again to serve them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict

from cluster import errors
from cluster.errors import APIError

log = logging.getLogger("ray.serve")

CATALOG_TTL_S = 2.0
"""A catalog copy older than this is refreshed in the background by the next adapter request."""
SYNC_PERIOD_S = 2.0
"""How often an engine replica compares its adapters with the record."""
STATE_TIMEOUT_S = 2.0
"""One read or write of the record on the index actor."""
ADMIN_CALL_TIMEOUT_S = 60.0
"""One replica's load or unload: reading a folder of safetensors, between two engine steps."""


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; its ``lora_int_id`` is ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str


def desired_adapters(modules, changes: dict[str, str | None]) -> dict[str, str]:
    """The adapters served: ``lora_modules`` (name, path) pairs with the runtime ``changes``
    applied (a path loads or replaces, None unloads)."""
    adapters = dict(modules)
    for name, path in changes.items():
        if path is None:
            adapters.pop(name, None)
        else:
            adapters[name] = path
    return adapters


def adapter_card(name: str, path: str, parent: str, max_model_len: int) -> dict:
    """An adapter's ``/v1/models`` entry, as vLLM lists it: ``root`` its folder, ``parent``
    the base model's served name."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "prefixserve",
        "root": path,
        "parent": parent,
        "max_model_len": max_model_len,
    }


class AdapterCatalog:
    """The ingress's copy of the adapters served (name -> folder)."""

    def __init__(
        self,
        modules,
        read_state: Callable[[], Awaitable[dict | None]],
        *,
        enabled: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``modules``: the engines' ``lora_modules``; ``read_state``: the record's
        ``{"epoch", "version", "adapters"}`` (None when unreachable); ``enabled``: the
        engines' ``enable_lora`` (off, no name is an adapter and nothing is read)."""
        self._modules = tuple(modules)
        self._read_state = read_state
        self.enabled = enabled
        self._clock = clock
        self.adapters: dict[str, str] = dict(self._modules) if enabled else {}
        self._read_at_s: float | None = None
        self._refreshing: asyncio.Task | None = None

    def apply(self, state: dict | None) -> None:
        """Takes a record read from (or just written to) the index actor."""
        if state is not None and self.enabled:
            self.adapters = desired_adapters(self._modules, state.get("adapters") or {})

    async def refresh(self) -> None:
        """Re-reads the record; concurrent callers share one read."""
        if not self.enabled:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._read())
        await asyncio.shield(self._refreshing)

    async def _read(self) -> None:
        self._read_at_s = self._clock()
        try:
            self.apply(await self._read_state())
        except Exception as exc:  # noqa: BLE001 - the last copy serves until the actor answers
            log.warning("LoRA adapters: reading the record failed: %r", exc)

    def _age_s(self) -> float:
        return float("inf") if self._read_at_s is None else self._clock() - self._read_at_s

    async def lookup(self, name: str) -> str | None:
        """The folder of adapter ``name``, or None when no adapter has that name (after one
        re-read of the record, or the read already in flight)."""
        if not self.enabled:
            return None
        path = self.adapters.get(name)
        if path is not None:
            if self._age_s() >= CATALOG_TTL_S and (
                self._refreshing is None or self._refreshing.done()
            ):
                self._refreshing = asyncio.get_running_loop().create_task(self._read())
            return path
        await self.refresh()
        return self.adapters.get(name)


def replica_result(replica_id: str, status: int = 200, message: str = "") -> dict:
    """What an engine replica's ``load_lora_adapter``/``unload_lora_adapter`` returns."""
    return {"replica_id": replica_id, "status": status, "message": message}


async def call_every_replica(
    replicas: dict[str, Callable[[], object]],
    method: str,
    *args,
    timeout_s: float = ADMIN_CALL_TIMEOUT_S,
) -> dict[str, dict]:
    """``method(*args)`` on every replica at once; ``replicas``: id -> a function returning
    the replica's handle (``serve_compat.replica_of``, a blocking lookup, run in a thread).
    Returns each replica's result (``replica_result``); one that is gone, fails or does not
    answer within ``timeout_s`` has status 503."""

    async def one(replica_id: str, resolve) -> dict:
        try:
            handle = await asyncio.to_thread(resolve)
            result = await asyncio.wait_for(getattr(handle, method).remote(*args), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported per replica, never raised
            return replica_result(replica_id, 503, f"no answer: {type(exc).__name__}: {exc}")
        if not isinstance(result, dict) or not isinstance(result.get("status"), int):
            return replica_result(replica_id, 500, f"unexpected answer {result!r}")
        return result

    results = await asyncio.gather(*(one(rid, resolve) for rid, resolve in replicas.items()))
    return {result["replica_id"]: result for result in results}


def first_refusal(results: dict[str, dict], *, ignore: tuple[int, ...] = ()) -> dict | None:
    """The result to report among replicas that refused (a 4xx the client can act on before a
    5xx); None when every replica that answered took the change (statuses in ``ignore``
    count as taken)."""
    refusals = [
        r for r in results.values() if r["status"] != 200 and r["status"] not in ignore + (503,)
    ]
    if not refusals:
        return None
    return min(refusals, key=lambda r: (r["status"] >= 500, r["status"], r["replica_id"]))


def refusal_error(refusal: dict, results: dict[str, dict], action: str, param: str) -> APIError:
    """The client's error for one replica's refusal, naming the replica and how many of the
    replicas refused alike; ``param``: the request field a 400 blames."""
    same = sum(1 for r in results.values() if r["status"] == refusal["status"])
    where = f"replica {refusal['replica_id']}" + (f" (and {same - 1} more)" if same > 1 else "")
    message = f"{action} failed on {where}: {refusal['message']}"
    status = refusal["status"]
    if status == 404:
        return errors.not_found(message, "lora_name")
    if status == 409:
        return APIError(409, message, param="lora_name", code="lora_adapter_in_use")
    if status < 500:
        return errors.bad_request(message, param)
    return APIError(status, message)


def answered(results: dict[str, dict]) -> list[str]:
    """The replicas that answered (any status but the 503 of no answer)."""
    return sorted(rid for rid, r in results.items() if r["status"] != 503)


def unanswered_note(results: dict[str, dict]) -> str:
    """A sentence naming the replicas that did not answer (empty when all did)."""
    missing = sorted(rid for rid, r in results.items() if r["status"] == 503)
    if not missing:
        return ""
    return (
        f" {len(missing)} replica(s) did not answer ({', '.join(missing)}); they apply the "
        "change on their next sync."
    )


async def _record(record, catalog: AdapterCatalog, name: str, path: str | None) -> None:
    """Records a runtime change for replicas that start later; 503 when the index actor does
    not answer (the running replicas took the change already; the message says so)."""
    try:
        catalog.apply(await record.write(name, path))
    except Exception as exc:  # noqa: BLE001 - becomes the client's 503
        log.warning("recording LoRA adapter %r failed: %r", name, exc)
        raise errors.unavailable(
            f"LoRA adapter {name!r} was changed on the running replicas, but recording it for "
            f"replicas that start later failed ({type(exc).__name__}); retry the call"
        ) from None


async def load_everywhere(
    catalog: AdapterCatalog,
    record,
    replicas: Callable[[], Awaitable[dict]],
    name: str,
    path: str,
    base_names,
) -> str:
    """``/v1/load_lora_adapter``: loads adapter ``name`` from ``path`` on every replica
    (``replicas()``: id -> handle lookup, as ``call_every_replica`` takes), all or nothing,
    then records it (``record``: an ``AdapterRecord``). Returns vLLM's success text; raises
    ``APIError``: 400 for an empty or taken name or a folder a replica refuses, 503 when no
    replica answers or the record cannot be written."""
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise errors.bad_request("lora_name and lora_path must be non-empty", "lora_name")
    if name in base_names:
        raise errors.bad_request(f"{name!r} is the base model's name", "lora_name")
    await catalog.refresh()
    if name in catalog.adapters:
        raise errors.bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    handles = await replicas()
    results = await call_every_replica(handles, "load_lora_adapter", name, path)
    refusal = first_refusal(results)
    if refusal is not None:  # all or nothing: undone where it was taken
        taken = {rid: handles[rid] for rid, r in results.items() if r["status"] == 200}
        await call_every_replica(taken, "unload_lora_adapter", name)
        raise refusal_error(refusal, results, f"loading LoRA adapter {name!r}", "lora_path")
    if not answered(results):
        raise errors.unavailable(f"no engine replica answered the load of {name!r}")
    await _record(record, catalog, name, path)
    return f"Success: LoRA adapter '{name}' added successfully." + unanswered_note(results)


async def unload_everywhere(
    catalog: AdapterCatalog, record, replicas: Callable[[], Awaitable[dict]], name: str
) -> str:
    """``/v1/unload_lora_adapter``: unloads adapter ``name`` from every replica, all or
    nothing, then records it. Returns vLLM's success text; raises ``APIError``: 404 for an
    adapter not served, 409 when a replica has requests on it (it is loaded again where it was
    unloaded), 503 when no replica answers or the record cannot be written."""
    name = name.strip()
    await catalog.refresh()
    path = catalog.adapters.get(name)
    if path is None:
        raise errors.not_found(f"The lora adapter '{name}' cannot be found.", "lora_name")
    handles = await replicas()
    results = await call_every_replica(handles, "unload_lora_adapter", name)
    refusal = first_refusal(results, ignore=(404,))  # 404: gone there already
    if refusal is not None:  # all or nothing: loaded again where it was unloaded
        taken = {rid: handles[rid] for rid, r in results.items() if r["status"] == 200}
        await call_every_replica(taken, "load_lora_adapter", name, path)
        raise refusal_error(refusal, results, f"unloading LoRA adapter {name!r}", "lora_name")
    if not answered(results):
        raise errors.unavailable(f"no engine replica answered the unload of {name!r}")
    await _record(record, catalog, name, None)
    return f"Success: LoRA adapter '{name}' removed successfully." + unanswered_note(results)


class ReplicaAdapterSync:
    """Brings one engine's adapters to the application's record."""

    def __init__(
        self,
        replica_id: str,
        modules,
        read_state: Callable[[], Awaitable[dict | None]],
        engine_adapters: Callable[[], Awaitable[dict[str, str]]],
        load: Callable[[str, str], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
    ) -> None:
        self.replica_id = replica_id
        self._modules = tuple(modules)
        self._read_state = read_state
        self._engine_adapters = engine_adapters
        self._load, self._unload = load, unload
        self._applied: tuple | None = None
        """(epoch, version) of the record the engine matches."""

    async def sync(self) -> bool:
        """One pass: reads the record and, if it moved since the last pass that converged,
        loads and unloads until the engine matches it. Returns whether the engine matches
        (False when the actor did not answer or a change was refused: the next pass retries).
        Never raises."""
        try:
            state = await self._read_state()
        except Exception as exc:  # noqa: BLE001 - the next period tries again
            log.debug("replica %s: LoRA record unreachable: %r", self.replica_id, exc)
            return False
        if state is None:
            return False
        key = (state.get("epoch"), state.get("version"))
        if key == self._applied:
            return True
        changes = state.get("adapters") or {}
        desired = desired_adapters(self._modules, changes)
        converged = True
        try:
            current = await self._engine_adapters()
        except Exception as exc:  # noqa: BLE001 - a dead engine is the health check's business
            log.warning("replica %s: listing LoRA adapters failed: %r", self.replica_id, exc)
            return False
        for name, path in current.items():
            # Only what the record unloads or replaces goes: an adapter it does not name yet
            # may be a load in progress (the ingress records a load once it is everywhere).
            unloaded = name in changes and changes[name] is None
            replaced = name in desired and desired[name] != path
            if unloaded or replaced:
                converged &= bool(await self._try(f"unloading {name!r}", self._unload(name)))
        for name, path in desired.items():
            if current.get(name) != path:
                # A folder this engine refuses (ValueError) stays refused: logged once per
                # record, not retried; anything else is retried next period.
                loaded = await self._try(f"loading {name!r} from {path}", self._load(name, path))
                converged &= loaded is not False
        if converged:
            self._applied = key
        return converged

    async def _try(self, what: str, call: Awaitable[None]) -> bool | None:
        """True when done, None when refused for good (``ValueError`` of a load), False when
        to retry."""
        try:
            await call
            log.info("replica %s: LoRA sync: %s", self.replica_id, what)
            return True
        except KeyError:
            return True  # gone already
        except ValueError as exc:
            log.warning("replica %s: LoRA sync: %s refused: %s", self.replica_id, what, exc)
            return None if what.startswith("loading") else False
        except Exception as exc:  # noqa: BLE001 - logged; retried next period
            log.warning("replica %s: LoRA sync: %s failed: %r", self.replica_id, what, exc)
            return False

    async def run_forever(self, period_s: float = SYNC_PERIOD_S) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.sync()


class AdapterRecord:
    """The application's runtime LoRA record on its ``IndexActor``, read and written with
    ``STATE_TIMEOUT_S``; the actor handle is looked up again after a failure."""

    def __init__(self, app_name: str, router_config) -> None:
        self.app_name = app_name
        self.router_config = router_config
        self._actor = None

    async def _call(self, method: str, *args) -> dict:
        from cluster.index_actor import get_or_create_index_actor

        try:
            if self._actor is None:
                self._actor = await asyncio.to_thread(
                    get_or_create_index_actor, self.app_name, self.router_config
                )
            return await asyncio.wait_for(
                getattr(self._actor, method).remote(*args), STATE_TIMEOUT_S
            )
        except Exception:
            self._actor = None
            raise

    async def read(self) -> dict:
        return await self._call("lora_state")

    async def write(self, name: str, path: str | None) -> dict:
        return await self._call("set_lora_adapter", name, path)
