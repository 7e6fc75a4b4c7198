"""What an application's ingress shares with the request router Serve builds in its process.

Owns ``RouterContext`` and ``router_context(app_name)``: per application, the
``router.load.LoadTracker`` that both halves of the ingress feed (the request router Serve
builds for the handle to ``EngineReplica``, ``cluster.request_router``, reports decisions,
confirmations and completions; the ingress's ``EngineClient`` reports first outputs) and the
engine replicas' model id, which names the Redis index's keys (the ingress asks a replica for
it before serving, as it does for the block size and the hash namespace). Serve constructs
the request router itself, from pickled keyword arguments, so a live object cannot be handed
to it: this per-process map from application name to context is the one place the two meet.
It lives in a module of its own because Serve ships ``cluster/request_router.py`` to the
handle's process pickled by value, with copies of that module's globals, so a map there would
not be the one the ingress sees.

How it fails: a process that routes without an ingress (a bare handle) gets a context nobody
fills: a tracker no one reports first outputs to (``router.load`` says how such requests are
priced) and no model id, so a Redis-backed router there decides by load alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from router.load import LoadTracker


@dataclass
class RouterContext:
    """One application's routing state in this process, shared by its ingress and router."""

    load: LoadTracker = field(default_factory=LoadTracker)
    model_id: str | None = None
    """The engine replicas' model id (the Redis index's namespace), set by the ingress once
    a replica has described itself; None until then."""


_CONTEXTS: dict[str, RouterContext] = {}
_LOCK = threading.Lock()


def router_context(app_name: str) -> RouterContext:
    """This process's routing context for ``app_name``'s engine replicas, created on first
    use."""
    with _LOCK:
        context = _CONTEXTS.get(app_name)
        if context is None:
            context = _CONTEXTS[app_name] = RouterContext()
        return context
