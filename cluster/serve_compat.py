"""The one place that touches Ray Serve internals: names Serve does not promise to keep.

What prefixserve needs beyond Serve's public API (``ray.serve.request_router``):

- ``PendingRequest.metadata.internal_request_id`` (``RequestMetadata`` is private): the key
  that ties a routing decision to ``on_request_routed``/``on_request_completed``.
- ``PendingRequest.routing_context.should_backoff``: without it Serve retries a full set of
  replicas in a tight loop.
- ``ray.serve.context._set_request_context(_internal_request_id=...)`` and
  ``ray.serve._private.utils.generate_request_id``: each engine call gets its own internal id
  (``own_internal_request_id``). Serve copies the HTTP request's id into every handle call
  made while serving it, and its router keys pending requests by that id, so two calls
  pending at once (one completions request over several prompts) overwrite each other there
  and one of them is never routed.
- ``ray.serve._private.constants`` ``SERVE_CONTROLLER_NAME``/``SERVE_NAMESPACE`` and the
  controller's ``_register_shutdown_cleanup_actor`` (what Ray's own prefix router uses), so
  ``serve.shutdown()`` kills the index actor.
- ``PendingRequest.kwargs`` is public, but that Serve sends the call with the kwargs as they
  are after ``choose_replicas`` (``set_request_kwarg``) is how 2.5x/2.60 happen to work: the
  request router's KV-pull order travels to the replica that way.
- A peer replica called directly (``peer_replica``, a KV pull's export): Serve names each
  replica's actor ``ReplicaID.to_full_id_str()`` in ``SERVE_NAMESPACE``, and
  ``ReplicaActor.handle_request`` takes a pickled ``RequestMetadata`` (``call_method``) before
  the method's arguments. The call skips Serve's queue and rejection, not the replica's
  ``max_ongoing_requests`` slot. ``replica_of`` finds a replica of another deployment the
  same way (the ingress asking each engine replica for its LoRA adapters), by its app,
  deployment and unique id (``DeploymentID`` and ``ReplicaID`` are private).
- ``DeploymentHandle.options(_by_reference=False)``: a handle whose calls travel on Serve's
  gRPC channel between replicas instead of Ray actor calls (``stream_handle``,
  ``ClusterConfig.handle_transport``). Optional: a Ray without it (2.50 has none) calls by
  actor calls, with a warning.
- ``ServeController.get_target_groups`` (its ``TargetGroup``s are public, the call is not):
  the ingress replicas' own HTTP ports under direct ingress (``direct_ingress_targets``).

Everything else (``RequestRouter.curr_replicas``, ``RunningReplica.replica_id``/
``routing_stats``) is public. ``TESTED_RAY`` is the range these were checked against; it
matches the bound in ``pyproject.toml`` (``tests/test_private_apis.py`` keeps them equal).

How it fails: ``check_serve_internals()`` runs once, when ``cluster/request_router.py`` or
``cluster/index_actor.py`` is imported, and raises ``RuntimeError`` naming the missing
attribute, the installed Ray and ``TESTED_RAY``, rather than letting a request fail later
with an ``AttributeError``. The cleanup hook is best effort: missing, it is a warning; a call
that fails is logged at debug level, and serving never waits on it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter

log = logging.getLogger("ray.serve")

TESTED_RAY = ">=2.50,<2.61"
"""Ray versions whose Serve internals this module was checked against (``pyproject.toml``)."""


def missing_serve_internals() -> list[str]:
    """What this module needs and the installed Ray lacks; empty when all is there."""
    missing = []
    try:
        from ray.serve._private import constants
    except ImportError:
        return ["ray.serve._private.constants"]
    for name in ("SERVE_CONTROLLER_NAME", "SERVE_NAMESPACE"):
        if not hasattr(constants, name):
            missing.append(f"ray.serve._private.constants.{name}")
    try:
        from ray.serve._private.controller import ServeController
    except ImportError:
        missing.append("ray.serve._private.controller.ServeController")
    else:
        if not hasattr(ServeController, "_register_shutdown_cleanup_actor"):
            missing.append("ServeController._register_shutdown_cleanup_actor")
    pending_fields = {f.name: f for f in dataclasses.fields(PendingRequest)}
    for name, inner in (("metadata", "internal_request_id"), ("routing_context", "should_backoff")):
        field = pending_fields.get(name)
        if field is None:
            missing.append(f"PendingRequest.{name}")
            continue
        inner_type = _field_type(field)
        if inner_type is None or inner not in {f.name for f in dataclasses.fields(inner_type)}:
            missing.append(f"PendingRequest.{name}.{inner}")
    try:
        from ray.serve._private.utils import generate_request_id  # noqa: F401
        from ray.serve.context import _set_request_context  # noqa: F401
    except ImportError as exc:
        missing.append(f"ray.serve request context ({exc.name or exc})")
    for name in ("curr_replicas", "update_replicas", "on_request_routed", "on_request_completed"):
        if not hasattr(RequestRouter, name):
            missing.append(f"RequestRouter.{name}")
    if "kwargs" not in pending_fields:
        missing.append("PendingRequest.kwargs")
    missing.extend(_missing_peer_call())
    return missing


def _missing_peer_call() -> list[str]:
    """What ``peer_replica`` and ``replica_of`` need and the installed Ray lacks."""
    missing = []
    try:
        from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata
        from ray.serve._private.replica import ReplicaActor
    except ImportError as exc:
        return [f"ray.serve._private peer call ({exc.name or exc})"]
    if not hasattr(ReplicaID, "to_full_id_str"):
        missing.append("ReplicaID.to_full_id_str")
    deployment_fields = {f.name for f in dataclasses.fields(DeploymentID)}
    if not {"name", "app_name"} <= deployment_fields:
        missing.append("DeploymentID(name, app_name)")
    if not hasattr(ReplicaActor, "handle_request"):
        missing.append("ReplicaActor.handle_request")
    metadata_fields = {f.name for f in dataclasses.fields(RequestMetadata)}
    for name in ("request_id", "internal_request_id", "call_method", "app_name"):
        if name not in metadata_fields:
            missing.append(f"RequestMetadata.{name}")
    return missing


def _field_type(field: dataclasses.Field) -> type | None:
    """The dataclass a ``PendingRequest`` field holds; None if that cannot be told (a string
    annotation with no dataclass default), which counts as missing."""
    if dataclasses.is_dataclass(field.type):
        return field.type
    factory = field.default_factory
    return factory if dataclasses.is_dataclass(factory) else None


def missing_message(missing: list[str]) -> str:
    """The error for ``missing``: what, the installed Ray, the tested range."""
    return (
        f"prefixserve needs Ray Serve internals that ray {ray.__version__} lacks: "
        f"{', '.join(missing)}; it is tested with ray{TESTED_RAY} "
        f"(pip install 'ray[serve]{TESTED_RAY}')"
    )


_BEST_EFFORT = "ServeController._register_shutdown_cleanup_actor"
"""Missing, only ``serve.shutdown()`` leaves the index actor behind (it ends itself when idle):
a warning, not an error."""


@functools.cache
def check_serve_internals() -> None:
    """Raises ``RuntimeError`` if the installed Ray lacks what routing needs (a warning if it
    lacks only the cleanup hook); runs once per process."""
    missing = missing_serve_internals()
    if _BEST_EFFORT in missing:
        missing.remove(_BEST_EFFORT)
        log.warning(
            "%s; the index actor outlives serve.shutdown()", missing_message([_BEST_EFFORT])
        )
    if missing:
        raise RuntimeError(missing_message(missing))


def request_key(pending_request: PendingRequest) -> str:
    """Serve's id of one request, the same in ``choose_replicas`` and the routed/completed
    callbacks."""
    return pending_request.metadata.internal_request_id


def ask_to_back_off(pending_request: PendingRequest) -> None:
    """Makes Serve back off before routing ``pending_request`` again after a full set."""
    pending_request.routing_context.should_backoff = True


@functools.cache
def has_grpc_transport() -> bool:
    """Whether the installed Serve can send a handle's calls over gRPC (``_by_reference``)."""
    from ray.serve.handle import DeploymentHandle

    return "_by_reference" in inspect.signature(DeploymentHandle.options).parameters


def stream_handle(handle, *, grpc: bool):
    """``handle`` streaming, its calls on Serve's gRPC channel between replicas (``grpc``) or
    on Ray actor calls; actor calls, with a warning, where Serve has no gRPC transport."""
    if not has_grpc_transport():
        if grpc:
            log.warning(
                "ray %s has no gRPC transport between replicas; the ingress calls the engine "
                "replicas by Ray actor calls",
                ray.__version__,
            )
        return handle.options(stream=True)
    return handle.options(stream=True, _by_reference=not grpc)


def set_request_kwarg(pending_request: PendingRequest, name: str, value) -> None:
    """Sets keyword argument ``name`` of the call Serve is about to send (removes it for None);
    the replica that Serve sends it to receives it."""
    if value is None:
        pending_request.kwargs.pop(name, None)
    else:
        pending_request.kwargs[name] = value


class _PeerMethod:
    def __init__(self, actor, app_name: str, method: str) -> None:
        self._actor, self._app_name, self._method = actor, app_name, method

    def remote(self, *args, **kwargs):
        """An ``ObjectRef`` (awaitable) of the method's result."""
        import pickle

        from ray.serve._private.common import RequestMetadata
        from ray.serve._private.utils import generate_request_id

        request_id = generate_request_id()
        metadata = RequestMetadata(
            request_id=request_id,
            internal_request_id=request_id,
            call_method=self._method,
            app_name=self._app_name,
        )
        return self._actor.handle_request.remote(pickle.dumps(metadata), *args, **kwargs)


class PeerReplica:
    """Another replica of this replica's deployment, called directly on its actor:
    ``peer.export_prefix.remote(...)`` returns an awaitable ``ObjectRef``."""

    def __init__(self, actor, app_name: str) -> None:
        self._actor, self._app_name = actor, app_name

    def __getattr__(self, method: str) -> _PeerMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _PeerMethod(self._actor, self._app_name, method)


def peer_replica(own_replica_id, peer_unique_id: str) -> PeerReplica:
    """The replica ``peer_unique_id`` of the deployment of ``own_replica_id`` (a ``ReplicaID``,
    ``serve.get_replica_context().replica_id``). Blocks on a GCS lookup; raises ``ValueError``
    when no such actor lives."""
    deployment_id = own_replica_id.deployment_id
    return replica_of(deployment_id.app_name, deployment_id.name, peer_unique_id)


def replica_of(app_name: str, deployment_name: str, unique_id: str) -> PeerReplica:
    """Replica ``unique_id`` of deployment ``deployment_name`` in application ``app_name``,
    called directly on its actor. Blocks on a GCS lookup; raises ``ValueError`` when no such
    actor lives."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    deployment_id = DeploymentID(name=deployment_name, app_name=app_name)
    name = ReplicaID(unique_id, deployment_id).to_full_id_str()
    actor = ray.get_actor(name, namespace=serve_namespace())
    return PeerReplica(actor, app_name)


def tell_replicas(
    app_name: str, deployment_name: str, replica_ids, method: str, *args, timeout_s: float
) -> int:
    """Calls ``method(*args)`` on each of ``replica_ids`` of a deployment, directly on their
    actors, and waits up to ``timeout_s`` for the answers; returns how many answered. A
    replica that is gone, or fails, is skipped: for orders a stopping cluster gives."""
    refs = []
    for unique_id in replica_ids:
        try:
            replica = replica_of(app_name, deployment_name, unique_id)
            refs.append(getattr(replica, method).remote(*args))
        except ValueError:  # the replica is gone already
            continue
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answered = 0
    for ref in ready:
        try:
            ray.get(ref)
            answered += 1
        except Exception as exc:  # noqa: BLE001 - one replica's failure spares the others
            log.warning("%s on a replica of %s failed: %r", method, deployment_name, exc)
    return answered


def own_replica_id() -> str:
    """This replica's unique id within its deployment."""
    return serve.get_replica_context().replica_id.unique_id


def direct_ingress_targets(app_name: str) -> list[tuple[str, int]]:
    """(node ip, port) of each ingress replica of ``app_name`` that serves HTTP itself (Ray
    Serve's direct ingress), from the controller's HTTP target groups; empty when none does
    (direct ingress off, or no replica running yet). The replica listens on Serve's HTTP host
    at that port."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    groups = ray.get(controller.get_target_groups.remote(app_name), timeout=10.0)
    targets = []
    for group in groups:
        direct = bool(getattr(group, "ingress_deployment_name", ""))  # not the proxies
        if not direct or group.app_name != app_name or "HTTP" not in str(group.protocol):
            continue
        targets += [(target.ip, target.port) for target in group.targets]
    return sorted(set(targets))


def own_internal_request_id() -> str:
    """Gives the handle calls made from the current asyncio task (and its context copy) an
    internal request id of their own (see the module docstring for why) and returns it: the
    key the load tracker holds the next call under (``request_key``, ``router.load``)."""
    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _set_request_context

    internal_request_id = generate_request_id()
    _set_request_context(_internal_request_id=internal_request_id)
    return internal_request_id


def serve_namespace() -> str:
    from ray.serve._private.constants import SERVE_NAMESPACE

    return SERVE_NAMESPACE


def register_shutdown_cleanup(actor) -> None:
    """Asks the Serve controller to kill ``actor`` on ``serve.shutdown()``; best effort."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(actor)
    except Exception as exc:  # noqa: BLE001 - cleanup registration never blocks serving
        log.debug("could not register %r for cleanup at serve.shutdown(): %r", actor, exc)
